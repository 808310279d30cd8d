"""Traces of a run under a real ``langgraph dev``: one trace, under the run's ``invoke_agent`` span.

The server pulls each chunk of a run in an asyncio task of its own; before the run span was made
current per step, every inference and tool span here was its own trace with no parent. The spans
are read from the server's log, where ``FUSION_TRACES_EXPORTER=console`` prints them as JSON lines.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from langgraph_sdk import get_client

from fusion_graph_testing.fake_openai import FakeOpenAI, Reply
from tests.integration.test_langgraph_dev import dev_settings, serve


def spans_in(log: Path) -> list[dict[str, Any]]:
    """The spans the console exporter printed into the server's log."""
    found = []
    for line in log.read_text(encoding="utf-8").splitlines():
        if line.startswith("{") and '"trace_id"' in line:
            found.append(json.loads(line))
    return found


async def test_the_spans_of_a_langgraph_dev_run_are_one_trace_under_its_run_span(tmp_path: Path) -> None:
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    (workspace / "notes.txt").write_text("hello\n", encoding="utf-8")
    plan = Reply(content="Plan: list the workspace", tool_calls=[("list_dir", {"path": "."})])
    with FakeOpenAI([plan]) as cloud, FakeOpenAI([Reply(content="done")]) as local:
        settings = {
            **dev_settings(cloud, local, workspace, "sk-operator-key-for-the-real-cloud"),
            "FUSION_TRACES": "true",
            "FUSION_TRACES_EXPORTER": "console",
        }
        with serve(tmp_path, settings) as url:
            client: Any = get_client(url=url)
            [assistant] = await client.assistants.search(graph_id="fusion")
            thread = await client.threads.create()
            result = await client.runs.wait(
                thread["thread_id"],
                assistant["assistant_id"],
                input={"messages": [{"role": "user", "content": "what is in the workspace?"}]},
                context={"cloud_share": 30, "sub_runners": "off"},
                raise_error=False,
            )
            assert isinstance(result, dict) and "__error__" not in result, result
            log = tmp_path / "server.log"
            deadline = time.monotonic() + 30  # the run span ends as its stream does, around the answer
            while not [s for s in spans_in(log) if s["name"].startswith("invoke_agent")]:
                assert time.monotonic() < deadline, log.read_text(encoding="utf-8")[-3000:]
                time.sleep(0.2)
    spans = spans_in(log)
    [run] = [s for s in spans if s["name"].startswith("invoke_agent")]
    assert run["attributes"]["gen_ai.conversation.id"] == thread["thread_id"]  # a UUID, not [REDACTED]
    others = [s for s in spans if s is not run]
    assert {s["attributes"]["gen_ai.operation.name"] for s in others} == {"chat", "execute_tool"}
    assert {s["context"]["trace_id"] for s in spans} == {run["context"]["trace_id"]}
    assert all(s["parent_id"] == run["context"]["span_id"] for s in others), others
