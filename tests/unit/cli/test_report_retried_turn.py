"""A turn whose first attempt failed, continued on its thread: one turn in ``report``, its retry's steps.

``fusion-graph run --thread`` is how a CLI user goes on after a failed turn: the
same request, sent again. The retry keeps the turn's number (``sizing.turn.turn_number``)
and an inference no provider answered is no step (``routing.records.unanswered``),
so ``report`` does not show the failed attempt as a turn of its own.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fusion_graph.cli.run import run_task
from fusion_graph.context import FusionContext
from fusion_graph.errors import ChainExhausted
from fusion_graph.settings import FusionSettings
from fusion_graph_testing.fake_openai import FakeOpenAI, Reply
from tests.unit.cli.test_traces import invoke_json

LIST = Reply(content="", tool_calls=[("list_dir", {"path": "."})])
DOWN = Reply(content="down", status=500)


async def failed_then_continued(tmp_path: Path, first_cloud: list[Reply]) -> dict[str, object]:
    """Run a turn whose cloud answers ``first_cloud`` (then fails) and whose local leg fails, then again.

    Returns ``report --json``'s row of the thread.
    """
    db = tmp_path / "threads.sqlite"
    context = FusionContext(sub_runners="off")
    with FakeOpenAI([*first_cloud, DOWN]) as cloud, FakeOpenAI([DOWN]) as local:
        settings = FusionSettings(
            cloud_base_url=cloud.base_url,
            local_base_url=local.base_url,
            cloud_api_key="sk-test-0000",
            local_slots=2,
            workspace_root=str(tmp_path),
        )
        with pytest.raises(ChainExhausted):
            await run_task(
                "list the files", context=context, settings=settings, thread_id="t", new_thread=True, db=db
            )
        cloud.script([LIST])
        local.script([Reply(content="one file")])
        done = await run_task("list the files", context=context, settings=settings, thread_id="t", db=db)
    assert done.answer == "one file"
    assert done.turn == 0, "the retry is the same turn"
    report = invoke_json("report", "--db", str(db), "--json")
    row: dict[str, object] = report["threads"]["t"]
    return row


async def test_a_turn_that_raised_mid_turn_and_was_continued_counts_once(tmp_path: Path) -> None:
    # First attempt: the plan lists the directory, then the next step fails on both legs.
    row = await failed_then_continued(tmp_path, [LIST])
    assert row["turns"] == 1
    # Both plans ran and were paid for; the failed step is no step: the retry's step is.
    assert (row["steps"], row["plans"], row["continuation_steps"]) == (3, 2, 1)


async def test_a_turn_whose_plan_failed_and_was_continued_is_one_turn_of_one_step(tmp_path: Path) -> None:
    row = await failed_then_continued(tmp_path, [])
    assert (row["turns"], row["steps"], row["plans"]) == (1, 2, 1)
