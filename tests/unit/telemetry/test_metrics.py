"""Prometheus metrics: what a run counts equals the sums of its ``route_log``, and no secret is a label."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from fusion_graph import FusionContext, FusionSettings
from fusion_graph.providers.chain import all_cloud_cost
from fusion_graph.routing.records import placement_of
from fusion_graph.routing.score import score_band
from fusion_graph.telemetry import switch
from fusion_graph.telemetry.metrics import NAMES, Metrics
from fusion_graph_testing.fake_openai import FakeOpenAI, Reply
from tests.plugins.served import graph_over, turn_state

SECRET = "sk-planted-secret-0123456789abcdef"


@pytest.fixture
def registry() -> Iterator[CollectorRegistry]:
    """Metrics on, in a registry of the test's own; off again after it."""
    fresh = CollectorRegistry()
    switch.ACTIVE.metrics = Metrics(fresh)
    yield fresh
    switch.reset()


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    """The summed value of ``name``'s samples whose labels include ``labels``."""
    total = 0.0
    for metric in registry.collect():
        for s in metric.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def graph_with(cloud: FakeOpenAI, local: FakeOpenAI, **settings: Any) -> Any:
    """``graph_over`` with the planted secret as the cloud key."""
    return graph_over(cloud, local, cloud_key=SECRET, **settings)


async def run(graph: Any, how: str, context: FusionContext) -> dict[str, Any]:
    """One turn of three lookups (``turn_state``)."""
    return await turn_state(graph, "look up three keys", how, context)


@pytest.mark.parametrize("how", ["ainvoke", "messages"])
async def test_the_counts_equal_the_sums_of_the_route_log(registry: CollectorRegistry, how: str) -> None:
    calls = [
        Reply(content="", tool_calls=[("lookup", {"key": f"k{i}"})], prompt_tokens=300) for i in range(2)
    ]
    with (
        FakeOpenAI(calls) as cloud,
        FakeOpenAI(
            [
                Reply(
                    content="", tool_calls=[("lookup", {"key": "k2"})], prompt_tokens=400, cached_tokens=350
                ),
                Reply(content="done", prompt_tokens=500, cached_tokens=420),
            ]
        ) as local,
    ):
        graph = graph_with(cloud, local)
        state = await run(graph, how, FusionContext(cloud_share=30))
    log = state["route_log"]
    assert {r["leg"] for r in log} == {"cloud", "local"}
    counted = Counter((r["kind"], r["routed_leg"], r["leg"], r["provider"]) for r in log)
    for (kind, routed, leg, provider), n in counted.items():
        labels = {"kind": kind, "routed_leg": routed, "leg": leg, "provider": provider, "outcome": "answered"}
        assert sample(registry, "fusion_inferences_total", **labels) == n
    assert sample(registry, "fusion_inferences_total") == len(log)
    priced = [r for r in log if r["cost_usd"] is not None]
    assert sample(registry, "fusion_cost_usd_total") == pytest.approx(sum(r["cost_usd"] for r in priced))
    assert sample(registry, "fusion_unpriced_inferences_total") == len(log) - len(priced)
    # Savings: the local inferences at the cloud link's prices, cached tokens credited.
    cloud_link = (await graph.memory_runs.resolver.chain(FusionContext())).first_cloud
    assert cloud_link is not None
    expected = 0.0
    for r in priced:
        if r["leg"] == "cloud":
            expected += r["cost_usd"]
        else:
            cached = min(r["cached_tokens"] or 0, r["prompt_tokens"])
            expected += (r["prompt_tokens"] - cached) * 10e-6 + cached * 1e-6 + r["completion_tokens"] * 10e-6
    assert sample(registry, "fusion_all_cloud_cost_usd_total") == pytest.approx(expected)
    for leg in ("cloud", "local"):
        for kind, field in (
            ("prompt", "prompt_tokens"),
            ("cached", "cached_tokens"),
            ("completion", "completion_tokens"),
        ):
            want = sum(r[field] or 0 for r in log if r["leg"] == leg)
            assert sample(registry, "fusion_tokens_total", leg=leg, type=kind) == want
    local_steps = [r for r in log if r["leg"] == "local"]
    assert sample(registry, "fusion_placements_total", placement="in_process") == len(local_steps)
    scraped = generate_latest(registry).decode()
    assert SECRET not in scraped
    registered = {m.name + ("_total" if m.type == "counter" else "") for m in registry.collect()}
    assert registered == set(NAMES)


@pytest.mark.parametrize("how", ["ainvoke", "messages"])
async def test_failed_attempts_fallovers_and_cooldowns_are_counted_without_the_secret_in_the_error(
    registry: CollectorRegistry, how: str
) -> None:
    refused = Reply(status=500, content=f"upstream broke, key {SECRET}")
    with (
        FakeOpenAI([refused, refused, refused, refused]) as cloud,
        FakeOpenAI([Reply(content="local plan"), Reply(content="done")]) as local,
    ):
        graph = graph_with(cloud, local, provider_allowed_failures=0, provider_cooldown_s=600)
        state = await run(graph, how, FusionContext(cloud_share=30))
    plan = state["route_log"][0]
    assert plan["routed_leg"] == "cloud" and plan["leg"] == "local" and plan["attempts"]
    failed = sum(1 for r in state["route_log"] for _ in r["attempts"])
    assert sample(registry, "fusion_failed_attempts_total", error_class="server_error") == failed
    assert sample(registry, "fusion_fallovers_total", routed_leg="cloud", leg="local") == 1
    assert sample(registry, "fusion_provider_cooldown", provider=plan["attempts"][0]["provider"]) == 1
    assert SECRET not in generate_latest(registry).decode()


def test_bands_and_placements_name_what_the_dashboard_groups_by() -> None:
    assert [score_band(s) for s in (0, 19, 20, 59.5, 80, 100, None)] == [
        "0-19", "0-19", "20-39", "40-59", "80-100", "80-100", "-"
    ]  # fmt: skip

    def local(**placement: Any) -> Any:
        return {"leg": "local", "provider": "local:l", "extra": {}, "placement": placement}

    assert placement_of(local()) == "in_process"
    assert placement_of(local(lease="shared")) == "shared"
    assert placement_of(local(guest=True)) == "guest"
    assert placement_of(local(lease="unplaced: database down")) == "unplaced"
    assert placement_of(local(lease="unplaced: database down", guest=True)) == "unplaced"
    cloud = local()
    cloud["leg"] = "cloud"
    assert placement_of(cloud) is None


def test_all_cloud_is_none_for_an_unpriced_inference() -> None:
    record: Any = {"cost_usd": None, "leg": "local"}
    assert all_cloud_cost(record, chain=None) is None  # type: ignore[arg-type]


def test_metrics_off_is_the_default_and_costs_one_test() -> None:
    switch.reset()
    assert FusionSettings().metrics is False and FusionSettings().traces is False
    assert not switch.ACTIVE.on


def test_shared_state_failures_are_read_at_each_scrape(registry: CollectorRegistry) -> None:
    class Shared:
        failures = 0

    shared = Shared()
    switch.watch_shared(shared)
    assert sample(registry, "fusion_shared_state_failures_total") == 0
    shared.failures = 3
    assert sample(registry, "fusion_shared_state_failures_total") == 3


def test_pending_memory_runs_are_read_at_each_scrape(registry: CollectorRegistry) -> None:
    in_flight = [0]
    switch.watch_pending_memory(lambda: in_flight[0])
    assert sample(registry, "fusion_memory_runs_pending") == 0
    in_flight[0] = 2
    assert sample(registry, "fusion_memory_runs_pending") == 2
