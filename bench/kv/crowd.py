"""Many more threads than slots: does a returning thread still find its prefix?

A service has far more threads than llama-server has conversation slots. Here
``--multiples`` × the slots SWE-agent threads (``threads.gateway_threads``, routed
with ``route_trajectory``; cloud steps only count) take turns: each thread's
local steps are cut into turns of ``--steps-per-turn``, and the turns are served
round robin (every thread's first turn, then every thread's second, ...) by as
many turns at once as there are conversation slots, so between two turns of a
thread every other thread runs one: the thread is idle, its slot may go to
another, and its prefix must come back from llama-server's host prompt cache
(``--cache-ram``) or be prefilled again. Thread *i*'s turn *k* goes to worker
(*i* + *k*) mod N, a real process with its own ``ProviderResolver`` and placer
(``bench.kv.placement_worker``), which is told when the turn ends
(``placement.release``, as the graph's run queue does).

Policies:

* ``shared``: the graph's shared placement (``FUSION_SHARED_STATE=postgres``):
  leases, an idle lease taken over least recently used first, straight to the
  lease's box;
* ``in-process``: each worker's own lease table (``LocalLeases``; one box, one
  process);
* ``no-slot``: the same requests naming no slot, llama-server choosing (one box,
  one process): the baseline of llama-server alone.

Every request of the graph's placement is sent inside its slot's turn
(``Placement.hold``), as the graph sends it. Every box runs ``-np``
(conversation slots + the reflection slot) and its host prompt cache at
llama-server's default size; ``--flags`` picks what else: ``defaults`` (nothing
more: llama-server's ``--slot-prompt-similarity`` 0.1) and ``documented``
(``-sps 1``, as docs/deploying.md prescribes). Nothing is sent to the slots by
hand: the placement warms each box on first contact. Per variant: processed /
physical minimum (per thread, the tokens new since its previous local request),
the returning turns whose slot served another thread in between and how many of
them still processed no more than their minimum (restored from the host cache),
guests and idle leases taken over; with ``--check-answers`` every local answer
(``--answer-tokens`` greedy tokens) is also sent again alone to a server with no
host cache and compared (``fusion_graph_testing.answers``): the divergent ones
are counted. Run ``python -m bench.kv.crowd``; see bench/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import re
import tempfile
import time
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import httpx

from bench.kv.placement_worker import PlacementWorker
from bench.kv.plan import ThreadPlan
from bench.kv.report import TIMING_NOTE, VERDICT_WORDS, plain_table, progress
from bench.kv.results import over_minimum, step_record
from bench.kv.server import MAX_TOKENS, MODEL_N_CTX, ServerSetup, prepare_server
from bench.kv.threads import (
    MODEL_ALIAS,
    REQUEST_TIMEOUT_S,
    box_server,
    gateway_threads,
    plan_threads,
    swe_trajectories,
)
from bench.kv.workers import PlacementKind, parse_counts, truncate_plan, worker_env
from bench.kv.workers_results import PlacedStep, summarize_workers
from bench.traces import add_trace_arguments, explained, trace_files, write_results
from fusion_graph.providers.slots import box_name
from fusion_graph_testing.answers import MARGIN, TOP, WIDE_TOP, Exchange, divergent

if TYPE_CHECKING:
    from fusion_graph_testing import LlamaServer
    from fusion_graph_testing.postgres import PostgresCluster

Policy = Literal["shared", "in-process", "no-slot"]
POLICIES: tuple[Policy, ...] = ("shared", "in-process", "no-slot")
#: What the boxes are started with besides ``-np``: nothing, or what docs/deploying.md prescribes.
#: ``no-host-cache``: the documented flags with the host prompt cache off, the control that measures
#: what batching alone changes in the answers.
Flags = Literal["defaults", "documented", "no-host-cache"]
FLAG_SETS: tuple[Flags, ...] = ("defaults", "documented")
BOX_FLAGS: dict[Flags, tuple[str, ...]] = {
    "defaults": (),
    "documented": ("--slot-prompt-similarity", "1"),
    "no-host-cache": ("--slot-prompt-similarity", "1", "--cache-ram", "0"),
}
#: How the results name a box's host cache when its flags leave ``--cache-ram`` to llama-server.
DEFAULT_CACHE_RAM = "--cache-ram (llama-server's default)"
#: Greedy tokens of each answer compared with ``--check-answers``.
ANSWER_TOKENS = 8
#: Conversation slots in all (over every box), unless ``--slots`` says otherwise.
SLOTS = 8
#: Threads as multiples of the slots.
DEFAULT_MULTIPLES = (1, 3, 10)
#: Local steps of a thread replayed (its first ones), and how many make one turn.
LOCAL_STEPS = 6
STEPS_PER_TURN = 2
#: The targets (checked, not asserted): processed / minimum at 3x and 10x the slots.
TARGETS = {3: 1.05, 10: 1.10}
CLOUD_SHARE = 30


@dataclass(frozen=True)
class CrowdVariant:
    """One point of the grid: the policy, worker processes, boxes, threads per slot, the boxes' flags."""

    policy: Policy
    workers: int
    boxes: int
    multiple: int
    flags: Flags = "documented"

    @property
    def name(self) -> str:
        """``shared-w2-b1-x10-documented``."""
        return f"{self.policy}-w{self.workers}-b{self.boxes}-x{self.multiple}-{self.flags}"


def build_grid(
    multiples: Sequence[int], policies: Sequence[Policy], flag_sets: Sequence[Flags] = FLAG_SETS
) -> list[CrowdVariant]:
    """Shared over 1 and 2 workers and boxes, the others on one box and process; for each flag set."""
    grid = []
    for flags in flag_sets:
        for multiple in multiples:
            for policy in policies:
                if policy == "shared":
                    grid += [CrowdVariant(policy, w, b, multiple, flags) for b in (1, 2) for w in (1, 2)]
                else:
                    grid.append(CrowdVariant(policy, 1, 1, multiple, flags))
    return grid


def turn_order(plans: Sequence[ThreadPlan], steps_per_turn: int) -> list[tuple[int, int, list[int]]]:
    """``(thread index, turn, local step positions)`` round robin: every thread's turn 0, then turn 1..."""
    turns: list[list[list[int]]] = []
    for plan in plans:
        local = [step.position for step in plan.steps if step.leg == "local"]
        turns.append([local[i : i + steps_per_turn] for i in range(0, len(local), steps_per_turn)])
    longest = max((len(t) for t in turns), default=0)
    return [(i, k, turns[i][k]) for k in range(longest) for i in range(len(plans)) if k < len(turns[i])]


async def replay(
    variant: CrowdVariant,
    plans: Sequence[ThreadPlan],
    *,
    workers: Sequence[PlacementWorker],
    box_urls: Sequence[str],
    steps_per_turn: int,
    slots: int,
    answer_tokens: int | None = None,
    at_once: int | None = None,
) -> tuple[list[PlacedStep], float, list[Exchange]]:
    """Every turn, round robin, ``at_once`` (default ``slots``) at a time; a thread's turns in order.

    The steps, the seconds, and (``answer_tokens``: that many greedy tokens each, with their top 20)
    every local request with its answer.
    """
    box_index = {box_name(url): i for i, url in enumerate(box_urls)}
    order = turn_order(plans, steps_per_turn)
    done: dict[tuple[int, int], asyncio.Event] = {(i, k): asyncio.Event() for i, k, _ in order}
    queue: asyncio.Queue[tuple[int, int, list[int]]] = asyncio.Queue()
    for item in order:
        queue.put_nowait(item)
    out: list[PlacedStep] = []
    exchanges: list[Exchange] = []
    limits = httpx.Limits(max_connections=slots + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(REQUEST_TIMEOUT_S), limits=limits) as client:

        async def send(thread: str, messages: Sequence[Mapping[str, Any]], worker: int) -> dict[str, Any]:
            if variant.policy != "no-slot":
                reply = await workers[worker].step(thread, messages, answer_tokens=answer_tokens)
                if answer_tokens is not None:
                    exchanges.append(Exchange(reply["body"], reply["answer"]))
                return reply
            body: dict[str, Any] = {
                "model": MODEL_ALIAS,
                "messages": list(messages),
                "max_tokens": answer_tokens or MAX_TOKENS,
                "temperature": 0,
            }
            if answer_tokens is not None:
                body |= {"logprobs": True, "top_logprobs": TOP}
            response = await client.post(f"{box_urls[0]}/v1/chat/completions", json=body)
            response.raise_for_status()
            if answer_tokens is not None:
                exchanges.append(Exchange(body, response.json()))
            timings = response.json()["timings"]
            return {**timings, "slot": None, "box": box_urls[0], "notes": {}, "finished": time.time()}

        async def serve() -> None:
            while not queue.empty():
                i, k, positions = queue.get_nowait()
                if k > 0:
                    await done[(i, k - 1)].wait()
                plan = plans[i]
                thread = plan.trajectory.thread_id
                worker = (i + k) % len(workers) if workers else 0
                steps = {step.position: step for step in plan.steps}
                for position in positions:
                    reply = await send(thread, plan.trajectory.messages[:position], worker)
                    box = box_index.get(box_name(str(reply["box"])))
                    out.append(
                        PlacedStep(
                            step_record(plan.trajectory.file, steps[position], reply),
                            thread,
                            position,
                            run=k,
                            worker=worker,
                            box=box,
                            slot=reply.get("slot") if reply.get("slot") is not None else reply.get("id_slot"),
                            finished=float(reply["finished"]),
                            notes=dict(reply.get("notes") or {}),
                        )
                    )
                if workers and variant.policy != "no-slot":
                    await workers[worker].release(thread)
                done[(i, k)].set()

        started = time.perf_counter()
        await asyncio.gather(*(serve() for _ in range(at_once or slots)))
    return out, time.perf_counter() - started, exchanges


async def divergent_answers(alone_url: str, exchanges: Sequence[Exchange]) -> list[str]:
    """Each answer that leaves the same request run alone on ``alone_url`` (no host cache), described."""
    async with httpx.AsyncClient(base_url=alone_url, timeout=httpx.Timeout(REQUEST_TIMEOUT_S)) as client:
        return await divergent(client, list(exchanges))


def returning_turns(steps: Sequence[PlacedStep]) -> tuple[int, int]:
    """Returning local steps whose (box, slot) served another thread since the thread's last step there,
    and how many of those processed no more than their minimum (their prefix came back from the host cache).

    Without a named slot (``no-slot``), every returning step counts (llama-server chose the slot).
    """
    local = sorted((s for s in steps if s.local), key=lambda s: s.finished)
    last_on: dict[tuple[int | None, int | None], str] = {}
    seen: set[str] = set()
    displaced = restored = 0
    for step in local:
        where = (step.box, step.slot)
        if step.thread in seen and (step.slot is None or last_on.get(where) != step.thread):
            displaced += 1
            restored += step.record.prompt_n <= step.record.minimum
        seen.add(step.thread)
        last_on[where] = step.thread
    return displaced, restored


def run_one(
    variant: CrowdVariant,
    plans: Sequence[ThreadPlan],
    *,
    setup: ServerSetup,
    slot_ctx: int,
    steps_per_turn: int,
    slots: int,
    cluster: PostgresCluster | None,
    home_wait_s: float | None = None,
    alone_url: str | None = None,
    answer_tokens: int = ANSWER_TOKENS,
    all_at_once: bool = False,
) -> dict[str, Any]:
    """One variant on fresh boxes, workers and database; its leaf (``home_wait_s``: the workers' setting).

    ``alone_url``: a server with no host cache (OpenAI base URL) to send every answer again
    alone, counting the divergent ones (``--check-answers``).
    """
    name = variant.name
    np = slots // variant.boxes + 1  # and the reflection slot
    box_args = list(BOX_FLAGS[variant.flags])
    with ExitStack() as stack:
        boxes: list[LlamaServer] = [
            stack.enter_context(box_server(setup, np, slot_ctx * (slots + 1), f"{name}-box{i}", box_args))
            for i in range(variant.boxes)
        ]
        urls = [box.base_url for box in boxes]
        database = None
        workers: list[PlacementWorker] = []
        if variant.policy != "no-slot":
            kind: PlacementKind = "shared" if variant.policy == "shared" else "in-process"
            if kind == "shared":
                if cluster is None:
                    raise RuntimeError("shared placement needs the Postgres cluster")
                db = "crowd_" + re.sub(r"[^a-z0-9]+", "_", name)
                database = cluster.create_database(db)
                stack.callback(cluster.drop_database, db)
            env = worker_env(kind, local_base_url=boxes[0].openai_base_url, boxes=urls, database=database)
            if home_wait_s is not None:
                env["FUSION_SLOT_HOME_WAIT_S"] = f"{home_wait_s:g}"
            workers = [
                PlacementWorker(env, log_path=setup.logs / f"{name}-worker{i}.log")
                for i in range(variant.workers)
            ]
            for worker in workers:
                stack.callback(worker.stop)
            for worker in workers:
                worker.start()
        try:
            steps, wall, exchanges = asyncio.run(
                replay(
                    variant,
                    plans,
                    workers=workers,
                    box_urls=urls,
                    steps_per_turn=steps_per_turn,
                    slots=slots,
                    answer_tokens=answer_tokens if alone_url is not None else None,
                    at_once=len(plans) if all_at_once else None,
                )
            )
        except (RuntimeError, httpx.HTTPError) as error:
            tails = [f"--- {b.log_path.name}:\n{b.log_tail(12)}" for b in boxes]
            tails += [f"--- {w.log_path.name}:\n{w.log_tail(12)}" for w in workers]
            raise RuntimeError(f"{name}: {error}\n" + "\n".join(tails)) from error
    leaf = summarize_workers(steps, variant.boxes)
    displaced, restored = returning_turns(steps)
    local = [s for s in steps if s.local]
    if alone_url is not None:
        bad = asyncio.run(divergent_answers(alone_url, exchanges))
        leaf.update(answers_checked=len(exchanges), divergent_answers=len(bad), divergent_detail=bad[:20])
    leaf.update(
        policy=variant.policy,
        flags=variant.flags,
        workers=variant.workers,
        box_count=variant.boxes,
        multiple=variant.multiple,
        threads=len(plans),
        box_slots=np,
        displaced_returns=displaced,
        restored_returns=restored,
        idle_leases_taken=sum(1 for s in local if s.notes.get("took_idle_slot")),
        wall_s=round(wall, 2),
    )
    return leaf


# -- the report --------------------------------------------------------------------------


def checks(variants: Mapping[str, Mapping[str, Any]]) -> list[tuple[str, bool | None, str]]:
    """Each shared variant with the documented flags at a multiple with a target processes at most that
    many times the minimum; every variant of the graph's placement whose answers were checked has none
    divergent."""
    found = []
    for name, leaf in variants.items():
        limit = TARGETS.get(int(leaf["multiple"]))
        documented = leaf.get("flags", "documented") == "documented"
        if leaf["policy"] == "shared" and documented and limit is not None:
            found.append((name, *over_minimum(leaf, limit, "target")))
        bad = leaf.get("divergent_answers")
        if bad is not None and leaf["policy"] != "no-slot":
            found.append((name, bad == 0, f"{bad} of {leaf['answers_checked']} answers divergent (target 0)"))
    return found


def table(variants: Mapping[str, Mapping[str, Any]]) -> str:
    """One row per variant, at 80 columns (flags d: defaults, D: documented; bad: divergent answers)."""
    header = [
        "policy",
        "flags",
        "w",
        "boxes",
        "threads",
        "proc/min",
        "bad",
        "displ",
        "restored",
        "guests",
        "s",
    ]
    rows = []
    for leaf in variants.values():
        ratio = leaf.get("processed_over_minimum")
        bad = leaf.get("divergent_answers")
        rows.append(
            [
                str(leaf["policy"]),
                "D" if leaf.get("flags", "documented") == "documented" else "d",
                str(leaf["workers"]),
                f"{leaf['box_count']}x{leaf['box_slots']}",
                f"{leaf['threads']} ({leaf['multiple']}x)",
                f"{ratio:.3f}" if isinstance(ratio, float | int) else "-",
                f"{bad}/{leaf['answers_checked']}" if bad is not None else "-",
                str(leaf["displaced_returns"]),
                str(leaf["restored_returns"]),
                str(leaf["guest_requests"]),
                f"{leaf['wall_s']:.0f}",
            ]
        )
    return plain_table(header, rows, left=1)


def parse_policies(text: str) -> tuple[Policy, ...]:
    """``"shared,no-slot"`` -> those policies; an unknown name is refused."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    known: dict[str, Policy] = {p: p for p in POLICIES}
    if not names or any(name not in known for name in names):
        raise argparse.ArgumentTypeError(f"policies: {text!r}: each one of {list(POLICIES)}")
    return tuple(dict.fromkeys(known[name] for name in names))


def parse_flags(text: str) -> tuple[Flags, ...]:
    """``"defaults,documented"`` -> those flag sets; an unknown name is refused."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    known: dict[str, Flags] = {f: f for f in BOX_FLAGS}
    if not names or any(name not in known for name in names):
        raise argparse.ArgumentTypeError(f"flags: {text!r}: each one of {list(BOX_FLAGS)}")
    return tuple(dict.fromkeys(known[name] for name in names))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.kv.crowd",
        description="Threads several times the llama-server slots: prefixes from the host prompt cache.",
    )
    add_trace_arguments(parser)
    parser.add_argument(
        "--multiples",
        type=parse_counts,
        default=DEFAULT_MULTIPLES,
        metavar="N,N",
        help=f"threads as multiples of the slots (default {','.join(map(str, DEFAULT_MULTIPLES))})",
    )
    parser.add_argument(
        "--policies",
        type=parse_policies,
        default=POLICIES,
        metavar="LIST",
        help=f"any of {', '.join(POLICIES)} (default: all)",
    )
    parser.add_argument(
        "--slots",
        type=int,
        default=SLOTS,
        metavar="N",
        help=f"conversation slots in all, an even number (default {SLOTS})",
    )
    parser.add_argument(
        "--local-steps",
        type=int,
        default=LOCAL_STEPS,
        metavar="N",
        help=f"each thread's first N local steps (default {LOCAL_STEPS})",
    )
    parser.add_argument(
        "--steps-per-turn",
        type=int,
        default=STEPS_PER_TURN,
        metavar="N",
        help=f"local steps of one turn (default {STEPS_PER_TURN})",
    )
    parser.add_argument(
        "--flags",
        type=parse_flags,
        default=FLAG_SETS,
        metavar="LIST",
        help="what the boxes run with besides -np: any of defaults (llama-server's own), documented "
        "(-sps 1, as docs/deploying.md prescribes) (default: both)",
    )
    parser.add_argument(
        "--check-answers",
        action="store_true",
        help="send every local answer again alone to a server with no host cache and count the divergent",
    )
    parser.add_argument(
        "--all-at-once",
        action="store_true",
        help="serve every thread's turns at once (threads >> slots in flight: guests), not as many "
        "turns at once as there are slots",
    )
    parser.add_argument(
        "--answer-tokens",
        type=int,
        default=ANSWER_TOKENS,
        metavar="N",
        help=f"with --check-answers: greedy tokens of each answer (default {ANSWER_TOKENS})",
    )
    parser.add_argument(
        "--home-wait",
        type=float,
        default=None,
        metavar="S",
        help="the workers' FUSION_SLOT_HOME_WAIT_S (default: the setting's own default)",
    )
    parser.add_argument(
        "--cloud-share",
        type=int,
        default=CLOUD_SHARE,
        choices=range(101),
        metavar="0-100",
        help=f"the routing dial (default {CLOUD_SHARE})",
    )
    args = parser.parse_args(argv)
    if args.slots < 2 or args.slots % 2:
        parser.error(f"--slots: an even number of at least 2 (two boxes share them), got {args.slots}")
    if args.local_steps < 2 * args.steps_per_turn or args.steps_per_turn < 1:
        parser.error("--local-steps must hold at least two turns of --steps-per-turn")
    return args


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Tokenize, plan and replay every variant; return the results."""
    started = time.perf_counter()
    grid = build_grid(args.multiples, args.policies, args.flags)
    shared = any(v.policy == "shared" for v in grid)
    if shared:
        from fusion_graph_testing.postgres import PostgresCluster, check_os_user, find_bin_dir

        find_bin_dir()
        check_os_user()
    swe = swe_trajectories(args)
    results: dict[str, Any] = {}
    versions: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="kv-crowd-") as tmp, ExitStack() as stack:
        setup = prepare_server(Path(tmp))
        most = max(args.multiples) * args.slots
        threads = gateway_threads(swe, most)
        planned = plan_threads(setup, threads, args.cloud_share)
        every = [truncate_plan(planned.plans[t.thread_id], args.local_steps) for t in threads]
        progress(f"{len(swe)} SWE-agent trajectories as up to {most} threads; {len(grid)} variants")
        cluster = None
        if shared:
            cluster = stack.enter_context(PostgresCluster(prefix="kv-crowd-pg-"))
            versions["postgres"] = cluster.version()
        alone_url = None
        if args.check_answers:  # one slot, no host cache: each request alone, from an empty cache
            alone = box_server(setup, 1, planned.slot_ctx, "alone", ["--cache-ram", "0"])
            alone_url = stack.enter_context(alone).openai_base_url
        for variant in grid:
            plans = every[: variant.multiple * args.slots]
            leaf = run_one(
                variant,
                plans,
                setup=setup,
                slot_ctx=planned.slot_ctx,
                steps_per_turn=args.steps_per_turn,
                alone_url=alone_url,
                answer_tokens=args.answer_tokens,
                all_at_once=args.all_at_once,
                slots=args.slots,
                cluster=cluster,
                home_wait_s=args.home_wait,
            )
            results[variant.name] = leaf
            progress(
                f"{variant.name}: processed/minimum {leaf['processed_over_minimum']}, divergent answers "
                f"{leaf.get('divergent_answers', '-')}, displaced returns "
                f"{leaf['displaced_returns']} restored {leaf['restored_returns']}, guests "
                f"{leaf['guest_requests']}, idle leases taken {leaf['idle_leases_taken']}, {leaf['wall_s']} s"
            )
    meta = {
        "mode": "crowd",
        "traces": [str(p) for p in trace_files(args.traces)],
        "quick": args.quick,
        "trajectories": len(swe),
        "slots": args.slots,
        "multiples": list(args.multiples),
        "local_steps": args.local_steps,
        "steps_per_turn": args.steps_per_turn,
        "turn_order": "round robin: every thread's turn k before any thread's turn k+1, "
        f"{'every thread' if args.all_at_once else args.slots} turns at once; thread i's turn k on worker "
        "(i + k) % N, released at its end",
        "cloud_share": args.cloud_share,
        "box_flags": {
            f: [*BOX_FLAGS[f], *([] if "--cache-ram" in BOX_FLAGS[f] else [DEFAULT_CACHE_RAM])]
            for f in args.flags
        },
        "slot_warm_up": "none by hand: the placement warms each box's empty slots on first contact",
        "answers": (
            f"every local answer ({args.answer_tokens} greedy tokens, top {TOP}) sent again alone to a "
            "--cache-ram 0 server with cache_prompt false; divergent: at the first differing token, the "
            f"loaded token is more than {MARGIN} nats below the alone answer's own among its top {TOP} "
            f"(top {WIDE_TOP} where it is not among the {TOP})"
            if args.check_answers
            else None
        ),
        "home_wait_s": args.home_wait,
        "llama_server_version": planned.llama_server_version,
        "model": f"tiny random-weight qwen2 (harness write_tiny_model), n_ctx {MODEL_N_CTX}",
        "ctx_per_slot": planned.slot_ctx,
        **versions,
        "timing_note": TIMING_NOTE,
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "wall_s": round(time.perf_counter() - started, 1),
    }
    return {"variants": results, "meta": meta}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the grid, print the table and the targets, write ``--out``."""
    args = parse_args(argv)
    result = explained(lambda: run(args), args.traces)
    if result is None:
        return 2
    found = checks(result["variants"])
    result["checks"] = [{"variant": n, "holds": h, "detail": d} for n, h, d in found]
    meta = result["meta"]
    print(
        f"Threads >> slots: {meta['trajectories']} SWE-agent trajectories, {meta['slots']} conversation "
        f"slots, turns of {meta['steps_per_turn']} local steps round robin; llama-server "
        f"{meta['llama_server_version'].removeprefix('version: ')}; flags d: llama-server's defaults, "
        "D: -sps 1"
    )
    print(table(result["variants"]))
    print("Targets (shared placement): " + ", ".join(f"{m}x <= {t:.2f}" for m, t in TARGETS.items()))
    for name, holds, detail in found:
        print(f"  {name}: {VERDICT_WORDS[holds]:<5}  {detail}")
    print(f"Note: {TIMING_NOTE}")
    print(f"Total wall time {meta['wall_s']} s.")
    write_results(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
