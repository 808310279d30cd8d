"""How much of each memory job's prompt llama-server serves from cache, replayed from agent traces.

Each trajectory in the traces is one thread. Its assistant messages are its
steps; a user message starts a new turn. Steps are sent to a real
llama-server (tiny random-weight qwen2 model, ``-np 4``: three conversation
slots and the reserved reflection slot) exactly as the graph sends them:
``bound_model`` with the thread's tools, ``build_prompt``, ``id_slot`` from a
``SlotPool`` and ``cache_prompt``. Memory jobs run where the graph runs them:
after each turn's last step, and beside every ``--every-k``-th step of a turn
(started once that step is answered, as ``steps_settled`` does), through the
project's own ``run_job`` on the reflection slot.

Variants, each on a freshly started server:

* ``warm``: the graph's jobs (the conversation as the steps send it, one
  instruction, priming), every step local;
* ``warm_fusion``: the same, with steps routed like the graph routes them at
  cloud_share 30 (cloud steps are not sent, so the local slot lacks them);
* ``unprimed``: warm prompts without the priming request;
* ``transcript``: the previous design, instructions plus a plain-text
  transcript of the turn.

A job's cache fraction is ``timings.cache_n / (cache_n + prompt_n)`` of its
first request; the target is judged on each thread's jobs from the second
on. Run ``python -m bench.memory_warm --help``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from langchain_core.messages import (
    AIMessage,
    BaseMessage,
    HumanMessage,
    SystemMessage,
    convert_to_messages,
    get_buffer_string,
)
from langchain_core.tools import BaseTool, StructuredTool
from pydantic import BaseModel, Field

from bench.kv.plan import CLOUD_SHARE, route_trajectory
from bench.kv.server import N_SLOTS, TEMPLATE, prepare_server, server_version, tokenize_requests
from bench.traces import (
    Trajectory,
    add_trace_arguments,
    explained,
    load_traces,
    select_quick,
    trace_files,
    write_results,
)
from fusion_graph import memory, prompts
from fusion_graph.memory import job_call
from fusion_graph.providers.chain import ProviderChain, bound_model
from fusion_graph.providers.llama_server import ChatLlamaServer
from fusion_graph.providers.models import Provider
from fusion_graph.providers.placement import FixedPlacement, Placement, slot_body
from fusion_graph.providers.slots import SlotPool
from fusion_graph.routing.records import timings_numbers
from fusion_graph.routing.score import DEFAULT_HYSTERESIS
from fusion_graph.sizing.turn import build_prompt

#: The issue's target: from a thread's second job on, this share of each job's prompt comes from cache.
TARGET = 0.80
GOAL = 0.90
#: Default K of ``memory_every_k_steps`` in the replay.
EVERY_K = 4
#: Completion budget of a job: enough for the shortest answer the schema allows, whitespace included.
JOB_MAX_TOKENS = 48
#: Room per slot above the longest conversation: tool schemas, the instruction, the answer.
CTX_ROOM = 2048


class TinyItem(BaseModel):
    """Enum and short strings."""

    kind: Literal["fact", "task"]
    text: str = Field(min_length=1, max_length=12)


class NoMemories(BaseModel):
    """An empty list, always: what is measured is the job's prompt, so its answer is kept short."""

    items: list[TinyItem] = Field(max_length=0)


JOB = memory.MemoryJob("bench_memories", NoMemories)


@dataclass(frozen=True)
class Variant:
    """How the replay sends steps and jobs."""

    name: str
    routed: bool
    prime: bool
    transcript: bool
    description: str


VARIANTS: tuple[Variant, ...] = (
    Variant("warm", False, True, False, "the graph's jobs: the steps' prefix + one instruction, primed"),
    Variant("warm_fusion", True, True, False, f"the same, steps routed at cloud_share {CLOUD_SHARE}"),
    Variant("unprimed", False, False, False, "warm prompts, no priming request"),
    Variant("transcript", False, False, True, "previous design: instructions + plain-text transcript"),
)


@dataclass(frozen=True)
class JobRecord:
    """One memory job as the server reported it."""

    file: str
    thread: str
    nth: int
    turn: int
    step: int
    trigger: str
    prompt_tokens: int
    cached_tokens: int
    primed: bool

    @property
    def fraction(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass
class StepCheck:
    """Whether a conversation's step right after a job still found its own prefix."""

    after_job: int = 0
    kept_prefix: int = 0


@dataclass(frozen=True)
class Step:
    """An assistant message of a trajectory: one step of a turn, and the jobs that follow it."""

    position: int
    turn: int
    step: int
    local: bool
    jobs: tuple[tuple[str, int], ...]  # (trigger, messages covered)


def plan_steps(messages: Sequence[BaseMessage], legs: Sequence[str], every_k: int) -> list[Step]:
    """Steps with the jobs the graph would run after them (every-K beside the next step, end of turn)."""
    assistant = [i for i, m in enumerate(messages) if isinstance(m, AIMessage)]
    steps: list[Step] = []
    turn, step = -1, 0
    for index, position in enumerate(assistant):
        starts_turn = any(
            isinstance(m, HumanMessage) for m in messages[(assistant[index - 1] if index else 0) : position]
        )
        turn, step = (turn + 1, 0) if starts_turn or turn < 0 else (turn, step + 1)
        jobs: list[tuple[str, int]] = []
        if every_k and step and step % every_k == 0:
            jobs.append(("every_k", position))  # beside this step: the messages it was sent
        following = messages[position + 1 : assistant[index + 1]] if index + 1 < len(assistant) else []
        ends_turn = index + 1 == len(assistant) or any(isinstance(m, HumanMessage) for m in following)
        if ends_turn:
            jobs.append(("end_of_turn", position + 1 if index + 1 < len(assistant) else len(messages)))
        steps.append(Step(position, turn, step, legs[index] == "local", tuple(jobs)))
    return steps


def tools_of(messages: Sequence[BaseMessage]) -> list[BaseTool]:
    """A tool per name the trajectory calls, with the argument names it uses (traces carry no schemas)."""
    names: dict[str, set[str]] = {}
    for message in messages:
        if isinstance(message, AIMessage):
            for call in message.tool_calls:
                names.setdefault(call["name"], set()).update(call["args"])
    return [
        StructuredTool.from_function(
            func=lambda **_: "",
            name=name,
            description=f"The trace's {name} tool.",
            args_schema={
                "type": "object",
                "properties": {arg: {"type": "string"} for arg in sorted(args)},
            },
        )
        for name, args in sorted(names.items())
    ]


def transcript_prompt(messages: Sequence[BaseMessage], max_chars: int = 65536) -> list[BaseMessage]:
    """The previous design's prompt: instructions, then the turn as plain text."""
    start = max((i for i, m in enumerate(messages) if isinstance(m, HumanMessage)), default=0)
    text = get_buffer_string(messages[start:])
    text = text if len(text) <= max_chars else "...\n" + text[-max_chars:]
    return [SystemMessage(prompts.MEMORY_INSTRUCTIONS), HumanMessage(text)]


@dataclass
class Replay:
    """One variant against one server."""

    variant: Variant
    link: Provider
    chain: ProviderChain
    pool: SlotPool
    jobs: list[JobRecord]
    checks: StepCheck


async def run_job(
    replay: Replay,
    trajectory: Trajectory,
    conversation: list[BaseMessage],
    system: str,
    tools: list[BaseTool],
    step: Step,
    trigger: str,
    nth: int,
) -> None:
    """One memory job, recorded by its first request's timings."""
    reflection = replay.pool.reflection_slot
    if replay.variant.transcript:
        model = replay.link.model.bind(
            max_tokens=JOB_MAX_TOKENS,
            extra_body={**(slot_body("local", reflection) or {}), "response_format": JOB.response_format()},
        )
        answer = await model.ainvoke(transcript_prompt(conversation))
        processed, reused, _ = timings_numbers(answer)
        primed = False
    else:
        runner = job_call.JobRunner(
            chain=replay.chain,
            leg="local",
            system_prompt=system,
            tools=tools,
            placer=FixedPlacement(Placement(slot=reflection)),
            thread_id=trajectory.thread_id,
            max_tokens=JOB_MAX_TOKENS,
            prime=replay.variant.prime,
        )
        _, records, dropped = await job_call.run_job(
            JOB, conversation, runner, turn=step.turn, step=step.step
        )
        if not records:
            raise RuntimeError(f"{trajectory.thread_id}: memory job got no answer: {dropped}")
        first = records[0]
        processed, reused = first["processed_tokens"], first["cached_tokens"]
        primed = bool(first.get("memory", {}).get("primed"))
    if processed is None or reused is None:
        raise RuntimeError("llama-server reported no timings for a memory job")
    replay.jobs.append(
        JobRecord(
            trajectory.file,
            trajectory.thread_id,
            nth,
            step.turn,
            step.step,
            trigger,
            processed + reused,
            reused,
            primed,
        )
    )


async def replay_thread(replay: Replay, trajectory: Trajectory, every_k: int) -> None:
    """Send one thread's local steps in order, each followed by the memory jobs the graph would run."""
    messages = convert_to_messages([dict(m) for m in trajectory.messages])
    system = messages[0].text if isinstance(messages[0], SystemMessage) else ""
    body = messages[1:] if isinstance(messages[0], SystemMessage) else list(messages)
    tools = tools_of(body)
    if replay.variant.routed:
        legs = [r.leg for r in route_trajectory(trajectory.messages, hysteresis=DEFAULT_HYSTERESIS)]
    else:
        legs = ["local"] * sum(isinstance(m, AIMessage) for m in body)
    slot = replay.pool.slot_for(trajectory.thread_id)
    model = bound_model(replay.link, tools).bind(extra_body=slot_body("local", slot))
    previous_prompt: int | None = None
    after_job = False
    nth = 0
    for step in plan_steps(body, legs, every_k):
        if step.local:
            answer = await model.ainvoke(build_prompt(system, body[: step.position]))
            processed, reused, _ = timings_numbers(answer)
            if processed is None or reused is None:
                raise RuntimeError("llama-server reported no timings for a step")
            if after_job and previous_prompt is not None:
                replay.checks.after_job += 1
                replay.checks.kept_prefix += reused >= previous_prompt
            previous_prompt, after_job = processed + reused, False
        for trigger, covers in step.jobs:
            nth += 1
            await run_job(replay, trajectory, body[:covers], system, tools, step, trigger, nth)
            after_job = True
    replay.pool.release(trajectory.thread_id)


def summarize(jobs: Sequence[JobRecord]) -> dict[str, Any]:
    """Cache fractions of the jobs: all of them, and each thread's from the second on."""
    later = [j for j in jobs if j.nth >= 2]
    first = [j for j in jobs if j.nth == 1]

    def share(chosen: Sequence[JobRecord]) -> float | None:
        prompt = sum(j.prompt_tokens for j in chosen)
        return sum(j.cached_tokens for j in chosen) / prompt if prompt else None

    fractions = [j.fraction for j in later]
    return {
        "jobs": len(jobs),
        "threads": len({j.thread for j in jobs}),
        "first_jobs_fraction": share(first),
        "later_jobs": len(later),
        "later_prompt_tokens": sum(j.prompt_tokens for j in later),
        "later_cached_tokens": sum(j.cached_tokens for j in later),
        "later_fraction": share(later),
        "later_min": min(fractions, default=None),
        "later_median": statistics.median(fractions) if fractions else None,
        "later_at_or_above_target": sum(f >= TARGET for f in fractions),
    }


async def run_variant(
    base_url: str, variant: Variant, trajectories: Sequence[Trajectory], every_k: int, concurrency: int
) -> tuple[list[JobRecord], StepCheck]:
    """Replay every thread against one server, ``concurrency`` threads at a time."""
    model = ChatLlamaServer(
        model="tiny",
        base_url=f"{base_url}/v1",
        api_key="none",
        max_tokens=1,
        temperature=0,
        max_retries=0,
        timeout=600,
    )
    link = Provider(id="local:tiny", leg="local", model=model)
    replay = Replay(variant, link, ProviderChain([link]), SlotPool(N_SLOTS), [], StepCheck())
    queue = list(trajectories)

    async def worker() -> None:
        while queue:
            await replay_thread(replay, queue.pop(0), every_k)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    await link.aclose()
    return replay.jobs, replay.checks


def format_table(results: Mapping[str, Mapping[str, Any]]) -> str:
    """Plain text: per variant, all traces then each file."""
    header = [
        "variant",
        "traces",
        "threads",
        "jobs",
        "2nd+ jobs",
        "2nd+ prompt",
        "2nd+ cached",
        "2nd+ fraction",
        "min",
        "median",
        ">= 80%",
        "1st jobs",
        "step kept prefix",
    ]
    rows = []
    for name, result in results.items():
        for label, leaf in [("all", result["all"]), *result["files"].items()]:
            check = result["steps_after_jobs"] if label == "all" else None
            rows.append(
                [
                    name if label == "all" else "",
                    label,
                    str(leaf["threads"]),
                    str(leaf["jobs"]),
                    str(leaf["later_jobs"]),
                    f"{leaf['later_prompt_tokens']:,}",
                    f"{leaf['later_cached_tokens']:,}",
                    _pct(leaf["later_fraction"]),
                    _pct(leaf["later_min"]),
                    _pct(leaf["later_median"]),
                    f"{leaf['later_at_or_above_target']}/{leaf['later_jobs']}",
                    _pct(leaf["first_jobs_fraction"]),
                    f"{check['kept_prefix']}/{check['after_job']}" if check else "",
                ]
            )
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        )

    return "\n".join([line(header), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def format_markdown(results: Mapping[str, Mapping[str, Any]]) -> str:
    """The README's table: each variant's jobs from a thread's second on, all traces."""
    lines = [
        "| variant | jobs (2nd+) | prompt tokens | cached | cached share | worst job | jobs >= 80 % "
        "| 1st jobs |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, result in results.items():
        a = result["all"]
        lines.append(
            f"| `{name}` | {a['later_jobs']} | {a['later_prompt_tokens']:,} | {a['later_cached_tokens']:,} | "
            f"{_pct(a['later_fraction'])} | {_pct(a['later_min'])} | "
            f"{a['later_at_or_above_target']}/{a['later_jobs']} | {_pct(a['first_jobs_fraction'])} |"
        )
    return "\n".join(lines)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.memory_warm",
        description="Cache fraction of memory jobs on a real llama-server, replayed from agent traces.",
    )
    add_trace_arguments(parser)
    parser.add_argument(
        "--every-k", type=int, default=EVERY_K, help=f"memory_every_k_steps (default {EVERY_K}; 0: off)"
    )
    parser.add_argument("--threads", type=int, default=1, help="threads replayed at once (default 1)")
    parser.add_argument(
        "--variants",
        default=",".join(v.name for v in VARIANTS),
        help="comma-separated, any of: " + ", ".join(v.name for v in VARIANTS),
    )
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Start a fresh server per variant, replay, summarize."""
    started = time.perf_counter()
    chosen = [v for v in VARIANTS if v.name in {n.strip() for n in args.variants.split(",")}]
    if not chosen:
        raise SystemExit(f"--variants: none of {args.variants!r} is one of {[v.name for v in VARIANTS]}")
    trajectories = load_traces(args.traces)
    if args.quick:
        trajectories = select_quick(trajectories)
    print(f"{len(trajectories)} trajectories", file=sys.stderr, flush=True)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="memory-warm-") as tmp:
        setup = prepare_server(Path(tmp))
        tokenizer = setup.server(n_slots=1, ctx_size=4096, name="tokenize")
        with tokenizer:
            version = server_version(tokenizer.binary)
            lengths = asyncio.run(tokenize_requests(tokenizer.base_url, [t.messages for t in trajectories]))
        slot_ctx = -(-(max(len(t) for t in lengths) + CTX_ROOM) // 256) * 256
        for variant in chosen:
            server = setup.server(n_slots=N_SLOTS, ctx_size=slot_ctx * N_SLOTS, name=variant.name)
            with server:  # a fresh process: no KV or host prompt cache carries over
                t0 = time.perf_counter()
                jobs, checks = asyncio.run(
                    run_variant(server.base_url, variant, trajectories, args.every_k, args.threads)
                )
                wall = time.perf_counter() - t0
            files = sorted({j.file for j in jobs})
            results[variant.name] = {
                "description": variant.description,
                "all": summarize(jobs),
                "files": {f: summarize([j for j in jobs if j.file == f]) for f in files},
                "steps_after_jobs": asdict(checks),
                "wall_s": round(wall, 1),
                "jobs": [{**asdict(j), "fraction": round(j.fraction, 4)} for j in jobs],
            }
            later = results[variant.name]["all"]["later_fraction"]
            print(
                f"{variant.name}: {len(jobs)} jobs, 2nd+ fraction {_pct(later)}, {wall:.1f} s",
                file=sys.stderr,
            )
    meta = {
        "traces": [str(p) for p in trace_files(args.traces)],
        "quick": args.quick,
        "trajectories": len(trajectories),
        "every_k": args.every_k,
        "threads": args.threads,
        "llama_server_version": version,
        "server_flags": f"-np {N_SLOTS} -c {slot_ctx * N_SLOTS} --jinja",
        "server_defaults_relied_on": "--cache-ram 8192 (MiB), --cache-idle-slots",
        "model": "tiny random-weight qwen2 (harness write_tiny_model), chat template " + TEMPLATE,
        "job_max_tokens": JOB_MAX_TOKENS,
        "target": TARGET,
        "goal": GOAL,
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "wall_s": round(time.perf_counter() - started, 1),
    }
    return {"variants": results, "meta": meta}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    result = explained(lambda: run(args), args.traces)
    if result is None:
        return 2
    meta = result["meta"]
    print(
        f"Memory job cache fraction: {meta['trajectories']} trajectories, every_k {meta['every_k']}, "
        f"{meta['threads']} thread(s) at once, llama-server {meta['server_flags']} "
        f"({meta['llama_server_version']})"
    )
    print(format_table(result["variants"]))
    print()
    print(format_markdown(result["variants"]))
    print(
        f"Target: from a thread's second job on, >= {TARGET:.0%} of each job's prompt cached "
        f"(goal {GOAL:.0%})."
    )
    write_results(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
