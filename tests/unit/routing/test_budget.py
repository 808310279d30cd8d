"""Cloud budgets per turn and per thread: the pure rule, and the graph keeping it with scripted servers."""

from __future__ import annotations

import pytest

from fusion_graph import ChainExhausted, FusionContext
from fusion_graph.routing.records import RouteRecord
from fusion_graph.routing.rule import (
    COMPLETION_FLOOR,
    CloudBudget,
    CloudSpend,
    StepPrice,
    check_budget,
    cloud_budget,
    cloud_spend,
    expected_completion,
    over_budget,
)
from fusion_graph_testing.fake_openai import FakeOpenAI, Reply
from tests.plugins.served import graph_over, turn_state

#: USD per million tokens of the scripted cloud model ``c``: a cent per thousand tokens either way.


def record(turn: int, leg: str, cost: float | None) -> RouteRecord:
    return {"turn": turn, "leg": leg, "cost_usd": cost}  # type: ignore[typeddict-item]


def test_a_run_may_only_lower_the_operators_budget() -> None:
    assert cloud_budget(
        operator_turn=0.05, operator_thread=None, run_turn=1.0, run_thread=0.2
    ) == CloudBudget(0.05, 0.2)
    assert cloud_budget(
        operator_turn=0.05, operator_thread=1.0, run_turn=0.01, run_thread=None
    ) == CloudBudget(0.01, 1.0)
    assert not cloud_budget(operator_turn=None, operator_thread=None, run_turn=None, run_thread=None).limited


def test_spend_counts_what_cloud_answered_in_the_turn_and_the_thread() -> None:
    log = [
        record(0, "cloud", 0.01),
        record(1, "cloud", 0.02),
        record(1, "local", 0.5),
        record(1, "cloud", None),
    ]
    assert cloud_spend(log, turn=1) == CloudSpend(turn_usd=0.02, thread_usd=0.03)


def test_the_reason_carries_the_numbers() -> None:
    budget = CloudBudget(turn_usd=0.05)
    assert (
        over_budget(budget, CloudSpend(0.048, 0.048), 0.004)
        == "turn budget $0.05: $0.048 spent, step ~$0.004"
    )
    assert over_budget(budget, CloudSpend(0.04, 0.04), 0.004) is None
    assert "price is unknown" in (over_budget(CloudBudget(thread_usd=1.0), CloudSpend(), None) or "")
    assert over_budget(CloudBudget(), CloudSpend(9, 9), None) is None


@pytest.mark.parametrize("how", ["ainvoke", "messages"])
async def test_a_turn_that_would_overspend_goes_local_at_the_step_that_would_pass_the_budget(
    how: str,
) -> None:
    calls = [
        Reply(content="", tool_calls=[("lookup", {"key": f"k{i}"})], prompt_tokens=300) for i in range(6)
    ]
    with (
        FakeOpenAI([*calls, Reply(content="done")]) as cloud,
        FakeOpenAI([Reply(content="local done")]) as local,
    ):
        graph = graph_over(cloud, local)
        context = FusionContext(cloud_share=100, max_completion_tokens=16, turn_cloud_budget_usd=0.012)
        state = await turn_state(graph, "look up six keys", how, context)
    log = state["route_log"]
    spent = 0.0
    for entry in log:
        assert entry["budget"]["step_usd"] > 0
        if entry["leg"] == "local":
            break
        assert spent + entry["budget"]["step_usd"] <= 0.012  # every cloud step was affordable
        spent += entry["cost_usd"]
    first_local = next(entry for entry in log if entry["leg"] == "local")
    assert first_local["routed_leg"] == "local" and first_local["kind"] == "step"
    assert spent + first_local["budget"]["step_usd"] > 0.012  # and this one was not
    assert f"turn budget $0.012: ${spent:.4f}".rstrip("0") in first_local["reason"]
    assert first_local["reason"].endswith(": local")
    assert state["messages"][-1].content == "local done"


@pytest.mark.parametrize("how", ["ainvoke", "messages"])
async def test_once_the_thread_budget_is_spent_plans_run_local(how: str) -> None:
    with (
        FakeOpenAI([Reply(content="cloud plan", prompt_tokens=1950)]) as cloud,
        FakeOpenAI([Reply(content="local plan")]) as local,
    ):
        graph = graph_over(cloud, local, thread_cloud_budget_usd=0.02)
        context = FusionContext(max_completion_tokens=16)
        await turn_state(graph, "first", how, context)
        state = await turn_state(graph, "second", how, context)
    plans = [entry for entry in state["route_log"] if entry["kind"] == "plan"]
    assert [p["leg"] for p in plans] == ["cloud", "local"]
    assert "thread budget $0.02: $0.0" in plans[1]["reason"] and plans[1]["reason"].endswith(": local")
    assert len(cloud.requests) == 1


@pytest.mark.parametrize("how", ["ainvoke", "messages"])
async def test_a_step_only_cloud_can_hold_and_the_budget_cannot_pay_ends_the_turn_clearly(how: str) -> None:
    with FakeOpenAI([Reply(content="cloud")]) as cloud, FakeOpenAI([Reply(content="local")]) as local:
        graph = graph_over(cloud, local, local_window_tokens=256, thread_cloud_budget_usd=0.0)
        state = await turn_state(graph, "word " * 2000, how, FusionContext(max_completion_tokens=16))
    assert cloud.requests == [] and local.requests == []
    last = state["route_log"][-1]
    assert last["outcome"]["status"] == "over_budget" and last["provider"] is None
    assert "local window 256" in last["sizing"]["fit"]
    text = state["messages"][-1].content
    assert "cloud budget does not allow it" in text and "thread budget $0.0" in text


@pytest.mark.parametrize("how", ["ainvoke", "messages"])
async def test_fallover_to_cloud_during_a_local_outage_respects_the_budget(how: str) -> None:
    with FakeOpenAI([Reply(content="cloud")]) as cloud, FakeOpenAI([Reply(status=503)]) as local:
        graph = graph_over(cloud, local, thread_cloud_budget_usd=0.0)
        with pytest.raises(ChainExhausted) as raised:
            await turn_state(graph, "hello", how, FusionContext(max_completion_tokens=16))
    assert cloud.requests == []  # the outage did not buy a cloud answer past the budget
    assert len(local.requests) >= 1
    assert "local" in str(raised.value)


async def test_without_a_budget_a_local_outage_still_falls_over_to_cloud() -> None:
    with FakeOpenAI([Reply(content="cloud")]) as cloud, FakeOpenAI([Reply(status=503)]) as local:
        graph = graph_over(cloud, local)
        state = await turn_state(
            graph, "hello", "ainvoke", FusionContext(cloud_share=0, max_completion_tokens=16)
        )
    assert state["route_log"][-1]["leg"] == "cloud" and len(cloud.requests) == 1
    assert "step_usd" not in state["route_log"][-1].get("budget", {})


async def test_the_operators_ceiling_binds_a_run_that_asks_for_more() -> None:
    with FakeOpenAI([Reply(content="cloud")]) as cloud, FakeOpenAI([Reply(content="local")]) as local:
        graph = graph_over(cloud, local, thread_cloud_budget_usd=0.0)
        state = await turn_state(graph, "hi", "ainvoke", FusionContext(thread_cloud_budget_usd=100.0))
    assert state["route_log"][0]["leg"] == "local" and "thread budget $0.0" in state["route_log"][0]["reason"]


# --------------------------------------------------------------------------- priced by what steps spend


def answered(completion: int | None) -> RouteRecord:
    made = record(0, "cloud", 0.0)
    made["completion_tokens"] = completion
    return made


def test_a_step_is_priced_at_what_the_threads_inferences_write_within_floor_and_budget() -> None:
    assert expected_completion([], ceiling=4096) == COMPLETION_FLOOR  # nothing written yet: the floor
    log = [answered(n) for n in (900, 1100, None, 1000)]
    assert expected_completion(log, ceiling=4096) == 1000  # the mean of what was written
    assert expected_completion(log, ceiling=600) == 600  # never past the completion budget
    assert expected_completion([answered(10), answered(20)], ceiling=4096) == COMPLETION_FLOOR


def test_the_call_is_capped_at_what_the_budget_still_pays_so_it_never_spends_past_it() -> None:
    budget = CloudBudget(thread_usd=0.05)
    step = StepPrice(prompt_usd=0.01, token_usd=0.00001)  # $10 per million output tokens
    spent = [record(0, "cloud", 0.02)]
    check = check_budget(budget, spent, 0, step, expected=500, ceiling=4096)
    assert check.over is None and check.step_usd == pytest.approx(0.015)
    assert check.max_tokens == 2000  # (0.05 - 0.02 - 0.01) / 0.00001
    assert 0.02 + (step.cost(check.max_tokens) or 0) <= 0.05 + 1e-12
    roomy = check_budget(budget, [], 0, step, expected=500, ceiling=1024)
    assert roomy.max_tokens == 1024  # the completion budget binds first
    tight = check_budget(budget, [record(0, "cloud", 0.036)], 0, step, expected=500, ceiling=4096)
    assert tight.over is not None and tight.max_tokens is None  # not even the expected answer fits


@pytest.mark.parametrize("how", ["ainvoke", "messages"])
async def test_a_capped_cloud_call_asks_for_no_more_than_the_budget_pays(how: str) -> None:
    with (
        FakeOpenAI([Reply(content="cloud answer", prompt_tokens=100)]) as cloud,
        FakeOpenAI([Reply(content="local")]) as local,
    ):
        graph = graph_over(cloud, local, thread_cloud_budget_usd=0.01)
        state = await turn_state(
            graph, "plan it", how, FusionContext(sub_runners="off", max_completion_tokens=4096)
        )
    [plan] = state["route_log"]
    body = cloud.requests[0]
    sent = int(body.get("max_completion_tokens") or body["max_tokens"])
    assert plan["leg"] == "cloud" and plan["budget"]["max_tokens"] == sent < 4096
    # What the call may write at most, with its prompt, stays within the budget ($10/M both ways).
    assert (plan["sizing"]["estimate"] + sent) * 10 / 1_000_000 <= 0.01


@pytest.mark.parametrize("how", ["ainvoke", "messages"])
async def test_memory_jobs_on_cloud_keep_the_budget_like_every_cloud_call(how: str) -> None:
    from langgraph.store.memory import InMemoryStore

    with (
        FakeOpenAI([Reply(content="cloud plan", prompt_tokens=1950)]) as cloud,
        FakeOpenAI([Reply(content="{}")] * 8) as local,
    ):
        graph = graph_over(cloud, local, store=InMemoryStore(), thread_cloud_budget_usd=0.02)
        context = FusionContext(max_completion_tokens=16, sub_runners="cloud", memory_mode="inline")
        state = await turn_state(graph, "plan it", how, context)
    jobs = [entry for entry in state["route_log"] if entry["kind"] == "memory"]
    assert jobs, state["route_log"]
    assert all(entry["routed_leg"] == "local" for entry in jobs)
    assert all(
        "thread budget $0.02" in entry["reason"] and entry["reason"].endswith(": local") for entry in jobs
    )
    assert len(cloud.requests) == 1  # the plan only: no job went to cloud, nor fell over to it


async def test_memory_jobs_on_cloud_run_there_while_the_budget_pays() -> None:
    from langgraph.store.memory import InMemoryStore

    with (
        FakeOpenAI([Reply(content="cloud plan"), *[Reply(content="{}")] * 8]) as cloud,
        FakeOpenAI() as local,
    ):
        graph = graph_over(cloud, local, store=InMemoryStore(), thread_cloud_budget_usd=5.0)
        context = FusionContext(max_completion_tokens=16, sub_runners="cloud", memory_mode="inline")
        state = await turn_state(graph, "plan it", "ainvoke", context)
    jobs = [entry for entry in state["route_log"] if entry["kind"] == "memory"]
    assert jobs and all(entry["routed_leg"] == "cloud" and "budget" not in entry["reason"] for entry in jobs)


def test_a_step_is_priced_ahead_by_one_function_with_its_cached_prefix_credited() -> None:
    from fusion_graph.providers.pricing import Pricing, TokenPrices, step_price

    pricing = Pricing.flat(TokenPrices(10.0, 20.0, 1.0))
    cold, warm = step_price(pricing, 1000), step_price(pricing, 1000, 800)
    assert cold.prompt_usd == pytest.approx(0.01) and cold.token_usd == pytest.approx(20.0 / 1e6)
    assert warm.prompt_usd == pytest.approx(200 * 10.0 / 1e6 + 800 * 1.0 / 1e6)  # 800 read from cache
    assert warm.cost(100) == pytest.approx((warm.prompt_usd or 0.0) + 100 * 20.0 / 1e6)
