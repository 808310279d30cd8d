"""The operator's cloud key is scrubbed from the first run, even one that never builds the cloud leg.

A local-only first run (``mode="local"``: no cloud model is built) reads a
workspace file that holds the key. The key is registered for scrubbing when the
graph reads its settings, so it reaches no message, no local request and no
checkpoint. Each run plants a key of its own: the registry is process-wide, and a
key some earlier test registered would let this one pass for the wrong reason.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest
from langgraph.checkpoint.memory import InMemorySaver

from fusion_graph import FusionContext, FusionSettings, build_graph
from fusion_graph.providers.llama_server import ChatLlamaServer
from fusion_graph.redact import REDACTED, registered_secrets
from fusion_graph_testing.fake_openai import FakeOpenAI, Reply
from tests.plugins.fakes import user_input

LOCAL = FusionContext(mode="local", memory_mode="inline", sub_runners="off")


def planted_key() -> str:
    """A key no rule but the registry catches (no ``sk-`` shape, chunks too short to look random)."""
    return "gw." + ".".join(uuid.uuid4().hex[:10] for _ in range(3))


def raw_checkpoints(saver: InMemorySaver) -> str:
    """Everything the saver stored, as text: checkpoints, channel blobs and pending writes."""
    parts: list[str] = []
    for store in (saver.storage, saver.blobs, saver.writes):
        parts.append(repr(store))
    return "".join(parts)


@pytest.mark.parametrize("how", ["ainvoke", "messages"])
@pytest.mark.parametrize("source", ["environment", "setting"])
async def test_a_local_only_first_run_never_carries_the_cloud_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str, source: str
) -> None:
    key = planted_key()
    assert key not in registered_secrets()
    monkeypatch.chdir(tmp_path)  # no .env of the repository's
    (tmp_path / "notes.txt").write_text(f"deploy notes\ncloud key: {key}\n")
    if source == "environment":
        monkeypatch.setenv("OPERATOR_TEST_CLOUD_KEY", key)
        settings = FusionSettings(
            workspace_root=str(tmp_path), cloud_api_key_env="OPERATOR_TEST_CLOUD_KEY", local_slots=2
        )
    else:
        settings = FusionSettings(workspace_root=str(tmp_path), cloud_api_key=key, local_slots=2)
    script = [
        Reply(content="", tool_calls=[("read_file", {"path": "notes.txt"})]),
        Reply(content="The notes hold deploy notes."),
    ]
    saver = InMemorySaver()
    with FakeOpenAI(script) as local:
        model = ChatLlamaServer(
            model="l", base_url=local.base_url, api_key="x", max_retries=0, stream_usage=True
        )
        graph = build_graph(local_model=model, settings=settings, checkpointer=saver)
        config: Any = {"configurable": {"thread_id": "first"}}
        streamed: list[str] = []
        if how == "ainvoke":
            await graph.ainvoke(user_input("What do the notes say?"), config, context=LOCAL)
        else:
            async for chunk, _ in graph.astream(
                user_input("What do the notes say?"), config, context=LOCAL, stream_mode="messages"
            ):
                streamed.append(repr(chunk))
        state = (await graph.aget_state(config)).values
        bodies = json.dumps(local.requests)
    tool_results = [m for m in state["messages"] if m.type == "tool"]
    assert len(tool_results) == 1 and REDACTED in tool_results[0].text  # the file was read, scrubbed
    assert len(local.requests) >= 2  # the request after the tool result went out
    assert key not in repr(state["messages"])
    assert key not in "".join(streamed)
    assert key not in bodies
    assert key not in raw_checkpoints(saver)
    checkpoints = [repr(item) async for item in saver.alist(config)]
    assert checkpoints and not [c for c in checkpoints if key in c]
