"""How often the cloud leg, asked beside a local step (a shadow check), took the same action, by score band.

The operator sees on real traffic whether the steps kept local are the ones
the local model gets right: agreement that falls in the higher score bands is
what a higher ``cloud_share`` would buy.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.table import Table

    from fusion_graph.routing.records import RouteRecord

#: Points per score band.
BAND = 20


def band_of(score: int | None) -> str:
    """The band a step's score falls in (``"80-100"``; ``"-"``: the step had no score)."""
    if score is None:
        return "-"
    low = min(int(score) // BAND * BAND, 100 - BAND)
    return f"{low}-{low + BAND - 1 if low + BAND < 100 else 100}"


def agreement(records: Iterable[RouteRecord]) -> dict[str, Any]:
    """The shadow checks among ``records``: checked, agreeing and their cost, in all and by score band."""
    bands: dict[str, dict[str, Any]] = {}
    checked = agreed = 0
    cost = 0.0
    for record in records:
        shadow = record["extra"].get("shadow") if record["kind"] == "shadow" else None
        if not shadow or shadow.get("agrees") is None:
            continue
        row = bands.setdefault(band_of(shadow.get("score")), {"checked": 0, "agree": 0})
        row["checked"] += 1
        row["agree"] += bool(shadow["agrees"])
        checked, agreed = checked + 1, agreed + bool(shadow["agrees"])
        cost += shadow.get("cost_usd") or 0.0
    for row in bands.values():
        row["agree_fraction"] = round(row["agree"] / row["checked"], 4)
    ordered = dict(sorted(bands.items(), key=lambda item: (item[0] == "-", item[0].zfill(7))))
    return {
        "checked": checked,
        "agree": agreed,
        "agree_fraction": round(agreed / checked, 4) if checked else None,
        "cost_usd": cost,
        "bands": ordered,
    }


def agreement_table(summary: dict[str, Any]) -> Table:
    """Shadow checks by score band: how many, how many agreed, and the share."""
    from fusion_graph.cli.tables import add_number_columns, compact_table

    table = compact_table(
        "shadow checks: did the cloud take the local step's action?",
        f"{summary['checked']} checks, ${summary['cost_usd']:.6f} on cloud; score bands of the local steps",
    )
    add_number_columns(table, "score", "checked", "agreed", "share")
    for band, row in summary["bands"].items():
        table.add_row(band, str(row["checked"]), str(row["agree"]), f"{row['agree_fraction']:.0%}")
    return table
