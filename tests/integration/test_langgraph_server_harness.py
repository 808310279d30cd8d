"""The graph on a real multi-process LangGraph server, driven with the official SDK.

Two ``langhost serve`` workers (stock ``langgraph-api`` on the Postgres +
Redis runtime) share one run queue: a run of a thread goes to whichever
worker is free, and the thread's checkpoints are in Postgres. Both legs point
at loopback fakes of the OpenAI API. Each worker executes one run at a time
(``N_JOBS_PER_WORKER=1``), so a worker kept busy with a run the cloud fake
holds open leaves every other run to the rest: that is how a test chooses
where a run executes without telling the server anything. Which worker ran
each attempt of a run is read from the workers' JSON logs.

What is shown: runs of many threads are spread over both workers and every
thread's history stays whole; a thread's consecutive turns run in different
processes, each seeing what the other wrote; a worker SIGKILLed in the middle
of a run leaves it to the other, which finishes it from the checkpoint (the
plan is not asked again, no message is lost or doubled), for a caller
waiting on the run (``runs.wait``) and for one streaming it
(``stream_mode="messages"``); restarted, the killed worker takes work again.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest
from langgraph_sdk import get_client

from fusion_graph_testing.fake_openai import FakeOpenAI, Reply
from fusion_graph_testing.langgraph_server import LangGraphServer
from tests.plugins.langgraph_server import StartServer

ROOT = Path(__file__).resolve().parents[2]
#: The graph the server serves: the first one in the repository's langgraph.json.
GRAPH = next(iter(json.loads((ROOT / "langgraph.json").read_text(encoding="utf-8"))["graphs"]))
#: The run context of every run (no memory sub-runners: exactly one model call per step).
CONTEXT = {"cloud_share": 30, "sub_runners": "off"}
#: Upper bound on any one wait (a run, a stream, a log line); generous for a 2-core machine.
WAIT_S = 240.0
#: A turn whose plan (cloud) lists the workspace; its next step runs on the local leg.
TOOL_TURN = "tool turn: what is in the workspace?"
PLAN_TEXT = "Plan: list the workspace"
#: How a blocker's user message starts: the cloud fake holds its reply until released.
BLOCKER = "blocker"
T = TypeVar("T")


def user_text(body: dict[str, Any]) -> str:
    """The last user message of a chat completions request (the turn's text)."""
    for message in reversed(body.get("messages", [])):
        if message.get("role") == "user":
            content = message.get("content")
            if isinstance(content, list):
                return "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
            return str(content)
    return ""


def answer(text: str) -> str:
    """What the cloud fake answers to a plain turn."""
    return f"answer to {text}"


def done(text: str) -> str:
    """What the local fake answers to the step after a tool turn's plan."""
    return f"done: {text}"


def history(body: dict[str, Any]) -> list[tuple[str, str]]:
    """``(role, text)`` of a request's user, assistant and tool messages (system prompts left out)."""
    return [
        (str(m.get("role")), str(m.get("content") or ""))
        for m in body.get("messages", [])
        if m.get("role") in ("user", "assistant", "tool")
    ]


@dataclass
class Fakes:
    """Both legs' fakes, answering by the turn's text.

    A plain turn gets ``answer(text)`` from the cloud (its plan step is the
    reply); ``TOOL_TURN`` gets a plan with a ``list_dir`` call from the cloud,
    then ``done(text)`` from the local leg, whose first request for a text in
    ``holds`` is held open until that event is set. A ``BLOCKER`` turn's
    cloud reply is held until its event in ``blockers`` is set.
    """

    workspace: Path
    cloud_delay: float = 0.0
    holds: dict[str, threading.Event] = field(default_factory=dict)
    blockers: dict[str, threading.Event] = field(default_factory=dict)
    cloud: FakeOpenAI = field(init=False)
    local: FakeOpenAI = field(init=False)

    def __post_init__(self) -> None:
        self.cloud = FakeOpenAI(self._cloud)
        self.local = FakeOpenAI(self._local)

    def _cloud(self, body: dict[str, Any]) -> Reply:
        text = user_text(body)
        if text in self.blockers:
            return Reply(content=f"{text}: released", hold=self.blockers[text])
        if text == TOOL_TURN:
            if body["messages"][-1].get("role") == "tool":  # not expected: the step routes local
                return Reply(content=f"cloud step of {text}")
            return Reply(content=PLAN_TEXT, tool_calls=[("list_dir", {"path": "."})])
        return Reply(content=answer(text), delay=self.cloud_delay)

    def _local(self, body: dict[str, Any]) -> Reply:
        text = user_text(body)
        asked = sum(1 for earlier in self.local.requests if user_text(earlier) == text)  # this one included
        if text in self.holds and asked == 1:
            return Reply(content="never delivered: its worker is killed first", hold=self.holds[text])
        return Reply(content=done(text))

    def cloud_requests(self, text: str) -> list[dict[str, Any]]:
        """The cloud requests of the turn ``text``."""
        return [body for body in self.cloud.requests if user_text(body) == text]

    def local_requests(self, text: str) -> list[dict[str, Any]]:
        """The local requests of the turn ``text``."""
        return [body for body in self.local.requests if user_text(body) == text]

    def env(self) -> dict[str, str]:
        """The operator's settings for the workers: both legs on the fakes."""
        return {
            "OPENAI_API_KEY": "sk-operator-key-of-the-fake-cloud",
            "FUSION_CLOUD_BASE_URL": self.cloud.base_url,
            "FUSION_LOCAL_BASE_URL": self.local.base_url,
            "FUSION_LOCAL_SLOTS": "4",
            "FUSION_WORKSPACE_ROOT": str(self.workspace),
        }

    def release_all(self) -> None:
        """Lets every held reply go (a test that failed half-way leaves none hanging)."""
        for event in (*self.holds.values(), *self.blockers.values()):
            event.set()


@pytest.fixture
def fakes(tmp_path: Path) -> Iterator[Fakes]:
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    (workspace / "notes.txt").write_text("hello\n", encoding="utf-8")
    scripted = Fakes(workspace)
    with scripted.cloud, scripted.local:
        try:
            yield scripted
        finally:
            scripted.release_all()


async def bounded(awaitable: Awaitable[T], what: str, server: LangGraphServer) -> T:
    """``awaitable`` within ``WAIT_S``; on timeout the failure shows every server log."""
    try:
        return await asyncio.wait_for(awaitable, WAIT_S)
    except TimeoutError:
        pytest.fail(f"{what} did not finish within {WAIT_S:.0f} s\n{server.log_tails()}")


async def until(check: Callable[[], Awaitable[bool]], what: str, server: LangGraphServer) -> None:
    """Polls ``check`` (every 0.1 s, at most ``WAIT_S``) until it holds."""

    async def poll() -> None:
        while not await check():
            await asyncio.sleep(0.1)

    await bounded(poll(), what, server)


def conversation(values: dict[str, Any]) -> list[tuple[str, str]]:
    """``(type, content)`` of a thread's messages."""
    return [(m["type"], m["content"]) for m in values["messages"]]


def assert_unique_ids(values: dict[str, Any]) -> None:
    ids = [m["id"] for m in values["messages"]]
    assert len(ids) == len(set(ids)), f"a message is in the thread twice: {ids}"


@dataclass
class Streamed:
    """What a ``stream_mode="messages"`` stream delivered."""

    attempts: list[int] = field(default_factory=list)
    ids: list[str] = field(default_factory=list)
    messages: dict[str, tuple[str, str]] = field(default_factory=dict)
    errors: list[Any] = field(default_factory=list)

    def add(self, event: str, data: Any) -> None:
        if event == "metadata" and isinstance(data, dict):
            self.attempts.append(int(data.get("attempt", 0)))
        elif event in ("messages/partial", "messages/complete"):
            for message in data:
                if message["id"] not in self.messages:
                    self.ids.append(message["id"])
                self.messages[message["id"]] = (message["type"], message["content"])
        elif event == "error":
            self.errors.append(data)

    def in_order(self) -> list[tuple[str, str, str]]:
        """``(id, type, content)`` of each streamed message, first-seen order, final content."""
        return [(id_, *self.messages[id_]) for id_ in self.ids]


class Turn:
    """One turn sent through one worker's API, by ``runs.wait`` or by a ``messages`` stream."""

    def __init__(
        self,
        client: Any,
        assistant: str,
        thread_id: str,
        text: str,
        mode: str,
        context: dict[str, Any] | None = None,
    ) -> None:
        self.client = client
        self.context = CONTEXT if context is None else context
        self.assistant = assistant
        self.thread_id = thread_id
        self.text = text
        self.mode = mode
        self.run_id: str | None = None
        self.created = asyncio.Event()
        self.streamed = Streamed()

    def _created(self, metadata: Any) -> None:
        self.run_id = str(metadata["run_id"])
        self.created.set()

    async def run(self) -> dict[str, Any] | None:
        """Sends the turn and waits until its run ends: the final values (wait), None (stream)."""
        payload = {"messages": [{"role": "user", "content": self.text}]}
        if self.mode == "wait":
            result = await self.client.runs.wait(
                self.thread_id,
                self.assistant,
                input=payload,
                context=self.context,
                raise_error=False,
                on_run_created=self._created,
            )
            assert isinstance(result, dict) and "__error__" not in result, result
            return result
        async for part in self.client.runs.stream(
            self.thread_id,
            self.assistant,
            input=payload,
            context=self.context,
            stream_mode="messages",
            on_run_created=self._created,
        ):
            self.streamed.add(part.event, part.data)
        assert not self.streamed.errors, self.streamed.errors
        return None


@dataclass(frozen=True)
class Blocker:
    """A run the cloud fake holds open, keeping the worker that runs it busy."""

    worker: int
    thread_id: str
    run_id: str
    text: str


@dataclass
class Occupation:
    """Blockers keeping chosen workers busy."""

    server: LangGraphServer
    fakes: Fakes
    client: Any
    blockers: list[Blocker] = field(default_factory=list)

    @property
    def workers(self) -> set[int]:
        """The workers kept busy."""
        return {blocker.worker for blocker in self.blockers}

    async def release(self) -> None:
        """Lets every blocker finish and waits for their runs."""
        for blocker in self.blockers:
            self.fakes.blockers[blocker.text].set()
        for blocker in self.blockers:
            await bounded(self.client.runs.join(blocker.thread_id, blocker.run_id), blocker.text, self.server)
        self.blockers.clear()


async def occupy(
    server: LangGraphServer, fakes: Fakes, client: Any, assistant: str, busy: set[int]
) -> Occupation:
    """Keeps the workers in ``busy`` each running a blocker, and no other worker.

    A blocker goes to whichever worker is free; one that lands outside ``busy``
    is kept until every worker in ``busy`` holds one (the queue has nowhere
    else to put the next), then released.
    """
    occupation = Occupation(server, fakes, client)
    spare = Occupation(server, fakes, client)
    for _ in range(len(server.workers)):  # each blocker takes one free worker (one job each)
        if busy <= occupation.workers:
            break
        text = f"{BLOCKER} {len(fakes.blockers)}"
        fakes.blockers[text] = threading.Event()
        thread = await client.threads.create()
        run = await client.runs.create(
            thread["thread_id"],
            assistant,
            input={"messages": [{"role": "user", "content": text}]},
            context=CONTEXT,
        )
        started = await asyncio.to_thread(server.wait_run_started, run["run_id"], timeout=WAIT_S)
        blocker = Blocker(started.worker, thread["thread_id"], run["run_id"], text)
        (occupation if started.worker in busy else spare).blockers.append(blocker)
    if not busy <= occupation.workers:
        await spare.release()
        await occupation.release()
        pytest.fail(f"could not keep workers {busy} busy\n{server.log_tails()}")
    await spare.release()
    return occupation


async def assistant_of(client: Any) -> str:
    assistants = await client.assistants.search(graph_id=GRAPH)
    assert assistants, f"the {GRAPH!r} graph is not served"
    return str(assistants[0]["assistant_id"])


async def test_eight_threads_of_three_turns_spread_over_both_workers(
    start_langgraph_server: StartServer, fakes: Fakes
) -> None:
    fakes.cloud_delay = 0.3  # each run holds its worker a moment: the other takes the next queued run
    server = start_langgraph_server(fakes.env(), workers=2)
    clients: list[Any] = [get_client(url=url) for url in server.urls]  # the SDK types JSON loosely
    assistant = await assistant_of(clients[0])
    threads, turns_per_thread = 8, 3

    async def converse(index: int) -> tuple[str, list[Turn]]:
        thread = await clients[index % 2].threads.create()
        turns = []
        for turn in range(turns_per_thread):
            # Each turn is sent to either worker; where it runs is the queue's choice.
            mode = "wait" if index % 2 == 0 else "stream"
            sent = Turn(
                clients[(index + turn) % 2], assistant, thread["thread_id"], f"t{index} turn {turn}", mode
            )
            await sent.run()
            turns.append(sent)
        return thread["thread_id"], turns

    results = await bounded(asyncio.gather(*(converse(i) for i in range(threads))), "the threads", server)

    ran_on: set[int] = set()
    for index, (thread_id, turns) in enumerate(results):
        state = await clients[index % 2].threads.get_state(thread_id)
        expected = [row for t in turns for row in (("human", t.text), ("ai", answer(t.text)))]
        assert conversation(state["values"]) == expected, thread_id
        assert_unique_ids(state["values"])
        runs = await clients[0].runs.list(thread_id)
        assert sorted(r["run_id"] for r in runs) == sorted(str(t.run_id) for t in turns)
        assert {r["status"] for r in runs} == {"success"}
        for position, turn in enumerate(turns):
            assert turn.run_id is not None
            attempts = server.run_attempts(turn.run_id)
            assert [(a.attempt, a.outcome) for a in attempts] == [(1, "success")], (turn.text, attempts)
            ran_on.add(attempts[0].worker)
            # Whichever worker ran it read the thread as the workers before it left it.
            [asked] = fakes.cloud_requests(turn.text)
            prior = [(("user" if kind == "human" else "assistant"), text) for kind, text in expected]
            assert history(asked) == [*prior[: 2 * position], ("user", turn.text)]
            if turn.mode == "stream":
                assert turn.streamed.attempts == [1]
                state_ai = state["values"]["messages"][2 * position + 1]
                assert turn.streamed.in_order() == [(state_ai["id"], "ai", answer(turn.text))]
    assert len(fakes.cloud.requests) == threads * turns_per_thread, "a turn asked the cloud twice"
    assert ran_on == {0, 1}, f"every run went to one worker: {server.all_attempts()}"


async def test_consecutive_turns_of_a_thread_run_in_different_workers(
    start_langgraph_server: StartServer, fakes: Fakes
) -> None:
    server = start_langgraph_server(fakes.env(), workers=2)
    clients: list[Any] = [get_client(url=url) for url in server.urls]  # the SDK types JSON loosely
    assistant = await assistant_of(clients[0])
    thread = await clients[0].threads.create()
    thread_id = thread["thread_id"]

    first = Turn(clients[0], assistant, thread_id, "turn 0", "wait")
    await bounded(first.run(), "turn 0", server)
    assert first.run_id is not None
    previous = server.ran_by(first.run_id)
    assert previous is not None
    turns, ran_by = [first], [previous]
    for number, mode in ((1, "stream"), (2, "wait")):
        # The worker that ran the last turn is kept busy: this turn can only run in the other one.
        occupation = await occupy(server, fakes, clients[0], assistant, busy={previous})
        turn = Turn(clients[previous], assistant, thread_id, f"turn {number}", mode)  # sent to the busy one
        await bounded(turn.run(), f"turn {number}", server)
        await occupation.release()
        assert turn.run_id is not None
        worker = server.ran_by(turn.run_id)
        assert worker is not None and worker != previous, server.run_attempts(turn.run_id)
        turns.append(turn)
        ran_by.append(worker)
        previous = worker
    assert ran_by[0] != ran_by[1] != ran_by[2]

    state = await clients[0].threads.get_state(thread_id)
    expected = [row for t in turns for row in (("human", t.text), ("ai", answer(t.text)))]
    assert conversation(state["values"]) == expected
    assert_unique_ids(state["values"])
    # Each turn's prompt is the whole thread so far, as the other process left it, nothing twice.
    for position, turn in enumerate(turns):
        [asked] = fakes.cloud_requests(turn.text)
        prior = [(("user" if kind == "human" else "assistant"), text) for kind, text in expected]
        assert history(asked) == [*prior[: 2 * position], ("user", turn.text)]
    for turn in turns:
        assert turn.run_id is not None
        assert [(a.attempt, a.outcome) for a in server.run_attempts(turn.run_id)] == [(1, "success")]


@pytest.mark.parametrize("sharing", ["in-process", "shared"])
@pytest.mark.parametrize("mode", ["wait", "stream"])
async def test_a_worker_killed_mid_run_leaves_the_run_to_the_other_which_finishes_it_from_the_checkpoint(
    start_langgraph_server: StartServer, fakes: Fakes, mode: str, sharing: str
) -> None:
    """Plan (cloud) and tool ran and were checkpointed; the local step is in flight when its worker dies.

    The caller talks to the surviving worker, kept busy meanwhile so the run can only start in the
    other; once the other is killed and the survivor freed, the survivor's sweep re-queues the run.
    With shared state the killed worker held the thread's run lock: it goes with its connection,
    so the takeover is not refused.
    """
    env = fakes.env() | ({"FUSION_SHARED_STATE": "postgres"} if sharing == "shared" else {})
    server = start_langgraph_server(env, workers=2)
    survivor, doomed = 0, 1
    client: Any = get_client(url=server.url(survivor))  # the caller's connection: the worker that lives
    assistant = await assistant_of(client)
    fakes.holds[TOOL_TURN] = threading.Event()
    thread = await client.threads.create()
    thread_id = thread["thread_id"]

    occupation = await occupy(server, fakes, client, assistant, busy={survivor})
    turn = Turn(client, assistant, thread_id, TOOL_TURN, mode)
    sent = asyncio.create_task(turn.run())
    await bounded(turn.created.wait(), "the run's creation", server)
    assert turn.run_id is not None
    run_id = turn.run_id
    started = await asyncio.to_thread(server.wait_run_started, run_id, timeout=WAIT_S)
    assert started.worker == doomed, server.run_attempts(run_id)

    async def step_in_flight() -> bool:
        return len(fakes.local_requests(TOOL_TURN)) == 1

    await until(step_in_flight, "the local step's request", server)

    async def plan_and_tool_checkpointed() -> bool:
        state = await client.threads.get_state(thread_id)
        return conversation(state["values"]) == [
            ("human", TOOL_TURN),
            ("ai", PLAN_TEXT),
            ("tool", "notes.txt"),
        ]

    await until(plan_and_tool_checkpointed, "the checkpoint after the tool call", server)
    assert not sent.done()

    assert server.kill(doomed) == -9
    fakes.holds[TOOL_TURN].set()  # the held response now goes to a dead socket
    await occupation.release()  # the survivor is free again: its sweep finds the run's heartbeat gone
    result = await bounded(sent, f"the run after its worker was killed ({mode})", server)

    attempts = server.run_attempts(run_id)
    assert [(a.worker, a.attempt, a.outcome) for a in attempts] == [
        (doomed, 1, None),  # killed before it could log an end
        (survivor, 2, "success"),
    ]
    run = await client.runs.get(thread_id, run_id)
    assert run["status"] == "success"
    state = await client.threads.get_state(thread_id)
    expected = [("human", TOOL_TURN), ("ai", PLAN_TEXT), ("tool", "notes.txt"), ("ai", done(TOOL_TURN))]
    assert conversation(state["values"]) == expected
    assert_unique_ids(state["values"])
    assert [(r["kind"], r["leg"]) for r in state["values"]["route_log"]] == [
        ("plan", "cloud"),
        ("step", "local"),
    ]

    # From the checkpoint: the plan was not asked again; the step was, once, with the history once.
    assert len(fakes.cloud_requests(TOOL_TURN)) == 1
    killed, retried = fakes.local_requests(TOOL_TURN)
    assert history(retried) == history(killed)
    assert [role for role, _ in history(retried)] == ["user", "assistant", "tool"]

    if mode == "wait":
        assert result is not None
        assert conversation(result) == expected
    else:
        assert turn.streamed.attempts == [1, 2]  # one stream, across both attempts
        streamed: Sequence[tuple[str, str, str]] = turn.streamed.in_order()
        in_state = [(m["id"], m["type"], m["content"]) for m in state["values"]["messages"][1:]]
        assert streamed == in_state, "the stream lost, doubled or re-sent a message"

    # The killed worker, restarted on its port, takes work again: the thread's next turn, here.
    url, pid = server.url(doomed), server.pids()[doomed]
    assert pid is None
    assert server.restart(doomed) == url
    occupation = await occupy(server, fakes, client, assistant, busy={survivor})
    after = Turn(client, assistant, thread_id, "after the restart", "wait")
    await bounded(after.run(), "the turn after the restart", server)
    await occupation.release()
    assert after.run_id is not None and server.ran_by(after.run_id) == doomed
    state = await client.threads.get_state(thread_id)
    assert conversation(state["values"]) == [*expected, ("human", after.text), ("ai", answer(after.text))]
    assert_unique_ids(state["values"])
