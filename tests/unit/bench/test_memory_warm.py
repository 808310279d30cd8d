"""Where the memory-job benchmark puts its jobs, without a server: where the graph would run them."""

from __future__ import annotations

from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage

from bench.memory_warm import plan_steps, tools_of
from tests.plugins.fakes import ai_calls, call


def conversation() -> list[BaseMessage]:
    """Turn 0: five steps (four tool batches, then a reply); turn 1: a direct reply."""
    messages: list[BaseMessage] = [HumanMessage("fix it")]
    for index in range(4):
        messages += [
            ai_calls(call("bash", {"command": f"ls {index}"}, f"c{index}")),
            ToolMessage("ok", tool_call_id=f"c{index}"),
        ]
    return [*messages, AIMessage("fixed"), HumanMessage("thanks"), AIMessage("welcome")]


def test_jobs_run_every_k_steps_beside_the_step_and_after_each_turn() -> None:
    messages = conversation()
    steps = plan_steps(messages, ["local"] * 6, every_k=2)
    assert [(s.position, s.turn, s.step) for s in steps] == [
        (1, 0, 0),
        (3, 0, 1),
        (5, 0, 2),
        (7, 0, 3),
        (9, 0, 4),
        (11, 1, 0),
    ]
    # Beside step k the job reads what that step was sent; after a reply, the turn with its reply.
    assert {s.position: s.jobs for s in steps if s.jobs} == {
        5: (("every_k", 5),),
        9: (("every_k", 9), ("end_of_turn", 10)),
        11: (("end_of_turn", 12),),
    }
    assert [s.jobs for s in plan_steps(messages, ["local"] * 6, every_k=0) if s.jobs] == [
        (("end_of_turn", 10),),
        (("end_of_turn", 12),),
    ]


def test_the_replay_binds_one_tool_per_name_the_trace_calls() -> None:
    [bash] = tools_of(conversation())
    assert bash.name == "bash"
    assert list(bash.args) == ["command"]
