"""The default graph runs a whole turn without a blocking call on the event loop.

``langgraph dev`` and the LangGraph server run graphs under blockbuster and
reject blocking I/O in async code; this runs the same check here. Both legs
use the default ``ChatOpenAI`` models built from the context, pointed at
OpenAI-compatible fakes on loopback, and the default workspace tools.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from blockbuster import blockbuster_ctx

from fusion_graph import build_graph
from fusion_graph.context import FusionContext
from fusion_graph.settings import FusionSettings
from fusion_graph_testing.fake_openai import FakeOpenAI, Reply
from tests.plugins.fakes import user_input


async def test_default_models_and_tools_never_block(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "test-key")
    (tmp_path / "a.txt").write_text("alpha\n")
    plan = Reply(content="Plan: read a.txt", tool_calls=[("read_file", {"path": "a.txt"})])
    edit = Reply(
        content="", tool_calls=[("replace_in_file", {"path": "a.txt", "old": "alpha", "new": "beta"})]
    )
    with FakeOpenAI([plan]) as cloud, FakeOpenAI([edit, Reply(content="done")]) as local:
        settings = FusionSettings(
            cloud_base_url=cloud.base_url,
            local_base_url=local.base_url,
            local_slots=4,
            workspace_root=str(tmp_path),
        )
        graph = build_graph(settings=settings)
        with blockbuster_ctx():
            result = await graph.ainvoke(user_input("edit a.txt"), context=FusionContext())
    assert [(r["kind"], r["leg"]) for r in result["route_log"]] == [
        ("plan", "cloud"),
        ("step", "local"),
        ("step", "local"),
    ]
    assert (tmp_path / "a.txt").read_text() == "beta\n"
    assert result["messages"][-1].content == "done"
    assert all(body["id_slot"] == result["route_log"][1]["slot"] for body in local.requests)
    assert all("id_slot" not in body and "cache_prompt" not in body for body in cloud.requests)


async def test_missing_cloud_key_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    graph = build_graph()
    with pytest.raises(ValueError, match="OPENAI_API_KEY"):
        await graph.ainvoke(user_input("hi"), context=FusionContext(cloud_share=30))
