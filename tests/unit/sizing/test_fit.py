"""The fit rule: which links can hold a step, the reason when it moves one, and the context budget."""

from __future__ import annotations

import pytest

from fusion_graph.routing.rule import (
    FALLBACK_CONVERSATION_TOKENS,
    LinkRoom,
    completion_budget,
    conversation_budget,
    fits,
    plan_fit,
    usable_window,
)


def rooms(
    local: int | None, cloud: int | None, *, prompt: int, cloud_prompt: int | None = None
) -> list[LinkRoom]:
    return [
        LinkRoom("cloud:a", "cloud", cloud, prompt if cloud_prompt is None else cloud_prompt),
        LinkRoom("local:b", "local", local, prompt),
    ]


@pytest.mark.parametrize(
    ("max_completion", "window", "expected"),
    [(512, 2048, 512), (4096, 2048, 1024), (4096, 8192, 4096), (4096, None, 4096), (100, 101, 50)],
)
def test_the_completion_budget_is_at_most_half_the_window(
    max_completion: int, window: int | None, expected: int
) -> None:
    assert completion_budget(max_completion, window) == expected


def test_a_step_fits_when_prompt_plus_budget_is_within_the_window() -> None:
    assert fits(LinkRoom("l", "local", 2048, 1536), 512)
    assert not fits(LinkRoom("l", "local", 2048, 1537), 512)
    assert fits(LinkRoom("l", "local", None, 10**9), 512), "an unknown window is assumed to fit"


def test_a_routed_leg_that_fits_keeps_the_step() -> None:
    plan = plan_fit("local", rooms(2048, 128_000, prompt=1000), 512)
    assert (plan.leg, plan.reason, plan.compact) == ("local", None, 0)
    assert plan.allowed == ("cloud:a", "local:b")


def test_a_step_the_local_window_cannot_hold_escalates_with_the_numbers() -> None:
    plan = plan_fit("local", rooms(2048, 128_000, prompt=2411), 512)
    assert plan.leg == "cloud"
    assert plan.allowed == ("cloud:a",)
    assert plan.reason == "prompt 2,411 + 512 > local window 2,048: escalated to cloud"


def test_a_step_the_cloud_window_cannot_hold_moves_to_local() -> None:
    plan = plan_fit("cloud", rooms(32_768, 8192, prompt=9000), 1024)
    assert (plan.leg, plan.allowed) == ("local", ("local:b",))
    assert plan.reason == "prompt 9,000 + 1,024 > cloud window 8,192: moved to local"


def test_when_no_window_holds_the_step_compaction_aims_at_the_largest() -> None:
    plan = plan_fit("local", rooms(2048, 4096, prompt=5000), 512)
    assert plan.allowed == ()
    headroom = (4096 - 512) // 4  # room for the steps after it, so compaction stays rare
    assert (plan.leg, plan.target, plan.compact) == ("cloud", "cloud:a", 5000 + 512 - 4096 + headroom)
    assert plan.reason == "prompt 5,000 + 512 > cloud window 4,096 (the largest window): compacted"


def test_each_leg_is_judged_on_its_own_estimate() -> None:
    # The cloud tokenizer counts fewer tokens for the same prompt: it still fits there.
    plan = plan_fit("cloud", rooms(32_768, 4096, prompt=4000, cloud_prompt=3500), 512)
    assert (plan.leg, plan.reason) == ("cloud", None)


def test_unknown_windows_never_block_a_step() -> None:
    plan = plan_fit("local", rooms(None, None, prompt=10**7), 4096)
    assert (plan.leg, plan.reason, plan.allowed) == ("local", None, ("cloud:a", "local:b"))


def test_the_budget_defaults_to_the_usable_local_window() -> None:
    assert usable_window(8192, 4096) == 4096
    assert conversation_budget(None, 8192, 4096) == 4096
    assert conversation_budget(None, 2048, 4096) == 1024  # the completion budget is at most half
    assert conversation_budget(1000, 8192, 4096) == 1000
    assert conversation_budget(None, None, 4096) == FALLBACK_CONVERSATION_TOKENS
    assert conversation_budget(2000, None, 4096) == 2000


def test_an_explicit_budget_larger_than_the_window_holds_is_refused_with_the_fix() -> None:
    with pytest.raises(ValueError) as caught:
        conversation_budget(32_768, 2048, 512)
    message = str(caught.value)
    assert "conversation_max_tokens 32,768" in message and "2,048 - completion budget 512 = 1,536" in message
    assert "leave it empty" in message and "-c / -np" in message
