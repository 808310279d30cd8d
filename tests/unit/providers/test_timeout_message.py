"""A request that outlasts ``request_timeout`` says which variable to raise, and its value.

The local server is a loopback fake that never answers (a CPU llama-server generating a
long completion looks the same from the client).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from langgraph.checkpoint.memory import InMemorySaver

from fusion_graph import FusionContext, FusionSettings, build_graph
from fusion_graph.errors import ChainExhausted
from fusion_graph.providers.chain import timeout_text
from fusion_graph_testing.fake_openai import FakeOpenAI, Reply
from tests.plugins.fakes import user_input

LOCAL = FusionContext(mode="local", sub_runners="off", max_completion_tokens=16)


@pytest.fixture
def hanging() -> Iterator[FakeOpenAI]:
    """A llama-server whose chat completions never answer (until the test ends)."""
    release = threading.Event()

    def answer(body: dict[str, Any]) -> Reply:
        # A chat completion names its model; a prompt count or template render is answered at once.
        return Reply(content="late", hold=release) if "model" in body else Reply()

    with FakeOpenAI(answer) as local:
        local.props = {"total_slots": 2, "default_generation_settings": {"n_ctx": 4096}}
        try:
            yield local
        finally:
            release.set()


async def test_a_local_request_that_times_out_names_fusion_request_timeout_and_its_value(
    hanging: FakeOpenAI, tmp_path: Path
) -> None:
    settings = FusionSettings(
        local_base_url=hanging.base_url, request_timeout=0.5, workspace_root=str(tmp_path)
    )
    graph = build_graph(settings=settings, checkpointer=InMemorySaver())
    with pytest.raises(ChainExhausted) as raised:
        await graph.ainvoke(user_input("hi"), {"configurable": {"thread_id": "t"}}, context=LOCAL)
    said = str(raised.value)
    assert "[timeout]" in said, said
    assert "raise FUSION_REQUEST_TIMEOUT (now 0.5)" in said, said
    assert "lower max_completion_tokens" in said and "fewer threads, -t" in said


def test_the_timeout_text_without_a_bound_names_no_variable_value() -> None:
    said = timeout_text("cloud:c", None)
    assert "FUSION_REQUEST_TIMEOUT" not in said and "client's own timeout" in said
    assert "threads" not in timeout_text("cloud:c", 30.0)  # thread advice is for a local llama-server only
