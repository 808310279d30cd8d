"""Operator settings refuse what would be silently wrong, and bound what an API caller may send."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from fusion_graph import ContextError, FusionContext, FusionSettings, InvalidInput, build_graph
from tests.plugins.fakes import scripted, user_input


def test_a_misspelt_setting_is_refused_with_the_right_name() -> None:
    with pytest.raises(ContextError, match=r"'requst_timeout' \(did you mean 'request_timeout'\?\)"):
        FusionSettings(requst_timeout=5)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"cloud_models": ("",)}, "at least 1 character"),
        ({"local_base_url": "not a url"}, "local_base_url must be an http:// or https:// URL"),
        ({"local_base_url": "ftp://box/v1"}, "local_base_url must be an http:// or https:// URL"),
        ({"cloud_base_url": "file:///etc/passwd"}, "cloud_base_url must be an http:// or https:// URL"),
    ],
)
def test_settings_that_cannot_work_are_refused_when_the_graph_is_built(
    settings: dict[str, object], message: str
) -> None:
    with pytest.raises(ValidationError, match=message):
        build_graph(settings=FusionSettings(**settings))


async def test_a_system_prompt_past_the_operators_bound_is_refused_before_any_call() -> None:
    model = scripted("any", ["never"])
    graph = build_graph(
        cloud_model=model, local_model=model, settings=FusionSettings(max_system_prompt_chars=1000)
    )
    with pytest.raises(
        ContextError, match="system_prompt is 4,000 characters; this deployment allows at most 1,000"
    ):
        await graph.ainvoke(
            user_input("hi"), context=FusionContext(system_prompt="x" * 4000, sub_runners="off")
        )
    assert model.prompts == []


async def test_input_past_the_operators_bound_is_refused_before_anything_is_written() -> None:
    model = scripted("any", ["never"])
    graph = build_graph(cloud_model=model, local_model=model, settings=FusionSettings(max_input_chars=100))
    with pytest.raises(InvalidInput, match="the input is 500 characters; this deployment takes at most 100"):
        await graph.ainvoke(user_input("y" * 500), context=FusionContext(sub_runners="off"))
    assert model.prompts == []


async def test_resuming_a_thread_that_has_nothing_to_resume_is_invalid_input() -> None:
    from langgraph.checkpoint.memory import InMemorySaver

    model = scripted("any", ["never"])
    graph = build_graph(cloud_model=model, local_model=model, checkpointer=InMemorySaver())
    with pytest.raises(InvalidInput, match="nothing to resume: thread 'new' has no checkpoint"):
        await graph.ainvoke(
            None, {"configurable": {"thread_id": "new"}}, context=FusionContext(sub_runners="off")
        )
    bare = build_graph(cloud_model=model, local_model=model)
    with pytest.raises(InvalidInput, match="nothing to resume"):
        await bare.ainvoke(None, context=FusionContext(sub_runners="off"))
    assert model.prompts == []
