"""The placement-cost benchmark: it times the placer's own path and reports both placements."""

from __future__ import annotations

import pytest

from bench.placement import table, timed
from fusion_graph.coordination.slot_leases import LocalLeases
from fusion_graph.providers.models import Provider, build_local_model
from fusion_graph.providers.placement import LeasedPlacement, ServerSlots
from fusion_graph.providers.pricing import FREE, Pricing
from fusion_graph.settings import FusionSettings


async def _no_props(link: Provider) -> None:
    return None


@pytest.mark.asyncio
async def test_each_thread_keeps_its_slot_while_it_is_timed() -> None:
    settings = FusionSettings(local_slots=5, local_base_url="http://127.0.0.1:9/v1")
    link = Provider("local:local", "local", build_local_model(settings), Pricing.flat(FREE))
    placer = LeasedPlacement(LocalLeases(), ServerSlots(settings, _no_props), boxes=(), box_model=None)

    result = await timed(placer, link, [f"t{i}" for i in range(4)], steps=3)

    assert result["moved"] == 0
    assert result["first_us_median"] > 0 and result["later_us_median"] > 0
    assert result["later_us_p99"] >= result["later_us_median"]


def test_the_table_has_a_row_per_placement() -> None:
    row = {"first_us_median": 7.0, "later_us_median": 3.0, "later_us_p99": 7.1, "moved": 0}
    shared = {**row, "first_us_median": 927.0}

    lines = table({"in_process": row, "shared": shared}).splitlines()

    assert lines[2] == "| in-process | 7.0 µs | 3.0 µs | 7.1 µs | 0 |"
    assert lines[3] == "| shared | 927.0 µs | 3.0 µs | 7.1 µs | 0 |"
