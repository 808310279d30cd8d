"""``--workers``: does the local leg reuse the prefix cache when a thread's runs land on different workers?

A deployment runs N worker processes, and a LangGraph server hands each run of
a thread to whichever one is free. Each worker here is a real process
(``bench.kv.placement_worker``: JSON lines over a loopback socket) with its own
``ProviderResolver`` built from its ``FUSION_*`` environment, so its own placer
(``resolver.placement``). The coordinator replays ``--threads``
SWE-agent threads at once (``threads.gateway_threads``, routed with
``route_trajectory``; cloud steps only count) and sends each thread's local
steps in order, in runs of ``--steps-per-run``: thread i's run k goes to worker
(i + k) mod N. A worker places the step (``placement.place``), sends the raw
request (``max_tokens: 1``, ``temperature: 0``, the placement's ``id_slot`` +
``cache_prompt`` and headers) to the placement's box when it names one, else to
the local link's base URL (the gateway, or the single box), tells the placer
which box a gateway answered from (``placement.served``), and returns
llama-server's ``timings``, the slot and the box.

Variants (each on fresh boxes, a fresh gateway, fresh workers and, when
shared, a fresh database):

* placement ``in-process`` (``shared_state`` off: every worker its own slot
  table) or ``shared`` (``FUSION_SHARED_STATE=postgres``, one database for all
  workers: slot leases);
* 1, 2 or 4 workers (``--workers``);
* 1 box (one llama-server) or 2 boxes: ``in-process`` goes through a real
  ``smg`` gateway by routing key (manual policy, min_group), as deployments do
  today; ``shared`` goes straight to the box its lease names (the gateway still
  runs and is the local base URL);
* slots ``tight`` (as many conversation slots in all as threads, plus each
  box's reserved reflection slot: ``-np 9`` on 1 box, ``-np 5`` per box on 2)
  or ``spare`` (twice as many), ``spare`` only at ``--spare-at`` workers.

Every box runs ``--cache-ram 0`` (``--cache-ram``): with llama-server's default
host prompt cache, a request pinned to a slot that is still prefilling another
thread's request hangs that slot (see ``CACHE_RAM_MIB``).

Per variant: processed / physical minimum (the one-box benchmark's minimum:
per thread, the tokens new since its previous local request), slot collisions
(a request on a (box, slot) whose previous request was another thread's),
thread moves (a thread's consecutive local requests on different (box, slot)),
threads per box and seconds. Run ``python -m bench.kv.reuse --workers 1,2,4``;
see bench/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import tempfile
import time
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from bench.kv.gateway import GATEWAY_VARIANTS, gateway_server
from bench.kv.placement_worker import PlacementWorker
from bench.kv.plan import ThreadPlan
from bench.kv.report import TIMING_NOTE, progress
from bench.kv.results import step_record
from bench.kv.server import MAX_TOKENS, MODEL_N_CTX, TEMPLATE, ServerSetup, prepare_server
from bench.kv.threads import (
    MODEL_ALIAS,
    REQUEST_TIMEOUT_S,
    box_server,
    gateway_threads,
    plan_threads,
    swe_trajectories,
)
from bench.kv.workers_results import (
    SHARED_OVER_MINIMUM,
    PlacedStep,
    evaluate_checks,
    format_checks,
    format_workers_table,
    summarize_workers,
)
from bench.traces import explained, trace_files, write_results
from fusion_graph.context import DEFAULTS
from fusion_graph.providers.slots import box_name

if TYPE_CHECKING:
    from fusion_graph_testing import LlamaServer
    from fusion_graph_testing.postgres import PostgresCluster

T = TypeVar("T")
PlacementKind = Literal["in-process", "shared"]
SlotMode = Literal["tight", "spare"]

#: Worker counts unless ``--workers`` says otherwise (``--workers`` alone turns this benchmark on).
DEFAULT_WORKERS = (1, 2, 4)
PLACEMENTS: tuple[PlacementKind, ...] = ("in-process", "shared")
#: Box counts of the default grid.
DEFAULT_BOXES = (1, 2)
SLOT_MODES: tuple[SlotMode, ...] = ("tight", "spare")
#: Worker counts the ``spare`` slots are also run at.
DEFAULT_SPARE_AT = (2,)
#: Threads replayed at once.
THREADS = 8
#: Local steps of a thread one worker sends before its next run goes to the next worker.
STEPS_PER_RUN = 5
#: ``--quick``: each thread's first local steps only (runs of ``STEPS_PER_RUN``, then a shorter one).
QUICK_LOCAL_STEPS = 7
#: Each box's ``--cache-ram`` (MiB) unless ``--cache-ram`` says otherwise: 0, off. With llama-server's
#: own default (8192) a request pinned to a slot that is still prefilling another thread's request
#: makes the server load a cached prompt into that busy slot, which then never finishes (100 % CPU);
#: in-process placement over several workers sends such requests. See bench/README.md.
CACHE_RAM_MIB = 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--workers`` and its own options, on ``bench.kv.reuse``'s parser."""
    parser.add_argument(
        "--workers",
        type=parse_counts,
        default=None,
        metavar="N,N",
        help="replay the SWE-agent traces as --threads threads whose runs go to N worker processes "
        f"round robin (e.g. {','.join(map(str, DEFAULT_WORKERS))}); see bench/kv/workers.py",
    )
    parser.add_argument(
        "--placements",
        type=parse_placements,
        default=PLACEMENTS,
        metavar="LIST",
        help=f"with --workers: any of {', '.join(PLACEMENTS)} (default: both)",
    )
    parser.add_argument(
        "--boxes",
        type=parse_counts,
        default=DEFAULT_BOXES,
        metavar="N,N",
        help=f"with --workers: llama-server boxes, 1 or 2 (default {','.join(map(str, DEFAULT_BOXES))})",
    )
    parser.add_argument(
        "--spare-at",
        type=lambda text: parse_counts(text, allow_empty=True),
        default=DEFAULT_SPARE_AT,
        metavar="N,N",
        help="with --workers: worker counts also run with spare slots, twice as many as threads "
        f"(default {','.join(map(str, DEFAULT_SPARE_AT))}; '' for none)",
    )
    parser.add_argument(
        "--cache-ram",
        type=int,
        default=CACHE_RAM_MIB,
        metavar="MIB",
        help=f"with --workers: each box's --cache-ram (default {CACHE_RAM_MIB}: off; llama-server's own "
        "default 8192 can hang a slot two threads' requests meet on, see bench/README.md)",
    )
    parser.add_argument(
        "--steps-per-run",
        type=int,
        default=STEPS_PER_RUN,
        metavar="N",
        help=f"with --workers: local steps of a thread per run (default {STEPS_PER_RUN})",
    )


# -- the grid ----------------------------------------------------------------------------


def parse_counts(text: str, *, allow_empty: bool = False) -> tuple[int, ...]:
    """``"1,2,4"`` -> ``(1, 2, 4)``: positive, distinct, in the given order."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from error
    if (not values and not allow_empty) or any(value < 1 for value in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return tuple(dict.fromkeys(values))


def parse_placements(text: str) -> tuple[PlacementKind, ...]:
    """``"shared,in-process"`` -> the placements named, in order; unknown names are refused."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    known: dict[str, PlacementKind] = {p: p for p in PLACEMENTS}
    unknown = [name for name in names if name not in known]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"placements: {unknown or text!r} is not one of {list(PLACEMENTS)}")
    return tuple(dict.fromkeys(known[name] for name in names))


@dataclass(frozen=True)
class WorkersVariant:
    """One point of the grid: where slots are decided, how many workers, boxes and slots."""

    placement: PlacementKind
    workers: int
    boxes: int
    slots: SlotMode

    @property
    def name(self) -> str:
        """``shared-w2-b2-tight``."""
        return f"{self.placement}-w{self.workers}-b{self.boxes}-{self.slots}"

    def box_slots(self, threads: int) -> int:
        """Each box's ``-np``: its share of the conversation slots plus its reflection slot."""
        conversation = threads if self.slots == "tight" else 2 * threads
        return -(-conversation // self.boxes) + 1


def build_grid(
    workers: Sequence[int],
    *,
    boxes: Sequence[int] = DEFAULT_BOXES,
    placements: Sequence[PlacementKind] = PLACEMENTS,
    spare_at: Sequence[int] = DEFAULT_SPARE_AT,
) -> list[WorkersVariant]:
    """Boxes × workers × placements with tight slots, then the same with spare slots at ``spare_at``."""
    grid = [
        WorkersVariant(placement, n, b, "tight") for b in boxes for n in workers for placement in placements
    ]
    grid += [
        WorkersVariant(placement, n, b, "spare") for b in boxes for n in spare_at for placement in placements
    ]
    return list(dict.fromkeys(grid))


# -- runs and workers --------------------------------------------------------------------


def runs_of(steps: Sequence[T], size: int) -> list[list[T]]:
    """Consecutive runs of ``size`` steps (the last one may be shorter)."""
    if size < 1:
        raise ValueError(f"steps per run must be >= 1, got {size}")
    return [list(steps[i : i + size]) for i in range(0, len(steps), size)]


def worker_for(thread_index: int, run_index: int, workers: int) -> int:
    """The worker of thread ``thread_index``'s run ``run_index``: round robin, starting at its own index."""
    return (thread_index + run_index) % workers


def step_workers(local_steps: int, thread_index: int, *, steps_per_run: int, workers: int) -> list[int]:
    """The worker of each of a thread's local steps, in order."""
    return [worker_for(thread_index, i // steps_per_run, workers) for i in range(local_steps)]


def truncate_plan(plan: ThreadPlan, local_steps: int) -> ThreadPlan:
    """The plan up to and including its ``local_steps``-th local step (``--quick``)."""
    kept = []
    seen = 0
    for step in plan.steps:
        if seen == local_steps:
            break
        kept.append(step)
        seen += step.leg == "local"
    return ThreadPlan(plan.trajectory, tuple(kept))


def worker_env(
    placement: PlacementKind, *, local_base_url: str, boxes: Sequence[str], database: str | None
) -> dict[str, str]:
    """The ``FUSION_*`` settings of every worker of a variant (the deployment's operator settings)."""
    env = {
        "FUSION_LOCAL_BASE_URL": local_base_url,
        "FUSION_LOCAL_MODEL": MODEL_ALIAS,
        "FUSION_REQUEST_TIMEOUT": str(REQUEST_TIMEOUT_S),
        "FUSION_SHARED_STATE": "off",
    }
    if len(boxes) > 1:
        env["FUSION_LOCAL_WORKERS"] = json.dumps([box_name(box) for box in boxes])
    if placement == "shared":
        if database is None:
            raise ValueError("shared placement needs a database")
        env["FUSION_SHARED_STATE"] = "postgres"
        env["FUSION_SHARED_STATE_URL"] = database
    return env


# -- the replay --------------------------------------------------------------------------


async def replay_thread(
    workers: Sequence[PlacementWorker],
    plan: ThreadPlan,
    thread_index: int,
    *,
    steps_per_run: int,
    box_index: Mapping[str, int],
    out: list[PlacedStep],
) -> None:
    """Send one thread's local steps in order, each run to its worker; cloud steps only count."""
    trajectory = plan.trajectory
    thread = trajectory.thread_id
    local = sum(1 for step in plan.steps if step.leg == "local")
    assigned = step_workers(local, thread_index, steps_per_run=steps_per_run, workers=len(workers))
    sent = 0
    for step in plan.steps:
        if step.leg == "cloud":
            out.append(PlacedStep(step_record(trajectory.file, step), thread, step.position))
            continue
        worker, run = assigned[sent], sent // steps_per_run
        sent += 1
        reply = await workers[worker].step(thread, trajectory.messages[: step.position])
        box = box_index.get(box_name(str(reply["box"])))
        if box is None:
            raise RuntimeError(f"{thread} step {step.position}: answered by an unknown box {reply['box']!r}")
        record = step_record(trajectory.file, step, reply)
        slot = reply["slot"]
        out.append(
            PlacedStep(
                record,
                thread,
                step.position,
                run=run,
                worker=worker,
                box=box,
                slot=int(slot) if slot is not None else None,
                finished=float(reply["finished"]),
                notes=dict(reply.get("notes") or {}),
            )
        )


async def replay_variant(
    workers: Sequence[PlacementWorker],
    plans: Sequence[ThreadPlan],
    *,
    steps_per_run: int,
    box_index: Mapping[str, int],
) -> tuple[list[PlacedStep], float]:
    """Start the workers, then replay every thread at once; the steps and the replay's seconds."""
    await asyncio.gather(*(asyncio.to_thread(worker.start) for worker in workers))
    out: list[PlacedStep] = []
    started = time.perf_counter()
    await asyncio.gather(
        *(
            replay_thread(workers, plan, i, steps_per_run=steps_per_run, box_index=box_index, out=out)
            for i, plan in enumerate(plans)
        )
    )
    return out, time.perf_counter() - started


def database_name(variant: WorkersVariant) -> str:
    """A Postgres database name for ``variant`` (lowercase letters, digits and ``_``)."""
    return "kv_" + re.sub(r"[^a-z0-9]+", "_", variant.name.lower())


def run_one(
    variant: WorkersVariant,
    plans: Sequence[ThreadPlan],
    *,
    setup: ServerSetup,
    slot_ctx: int,
    steps_per_run: int,
    cluster: PostgresCluster | None,
    cache_ram: int = CACHE_RAM_MIB,
) -> dict[str, Any]:
    """One variant on fresh boxes, gateway, workers and database; its leaf (``summarize_workers``)."""
    name = variant.name
    np = variant.box_slots(len(plans))
    box_args = ["--cache-ram", str(cache_ram)]
    with ExitStack() as stack:  # everything started here is stopped on exit, also on failure
        boxes: list[LlamaServer] = [
            stack.enter_context(box_server(setup, np, slot_ctx * np, f"{name}-box{i}", box_args))
            for i in range(variant.boxes)
        ]
        urls = [box.base_url for box in boxes]
        local_base_url = boxes[0].openai_base_url
        smg: list[str] = []
        if variant.boxes > 1:
            manual = GATEWAY_VARIANTS[0]  # manual + min_group by x-fusion-thread: what deployments run
            gateway = stack.enter_context(gateway_server(manual, urls, setup.logs / f"{name}-smg.log"))
            local_base_url = gateway.openai_base_url
            smg = gateway.args()[1:]
        database = None
        if variant.placement == "shared":
            if cluster is None:
                raise RuntimeError("shared placement needs the Postgres cluster")
            database = cluster.create_database(database_name(variant))
            stack.callback(cluster.drop_database, database_name(variant))
        env = worker_env(variant.placement, local_base_url=local_base_url, boxes=urls, database=database)
        workers = [
            PlacementWorker(env, log_path=setup.logs / f"{name}-worker{i}.log")
            for i in range(variant.workers)
        ]
        for worker in workers:
            stack.callback(worker.stop)
        box_index = {box_name(url): i for i, url in enumerate(urls)}
        try:
            steps, wall = asyncio.run(
                replay_variant(workers, plans, steps_per_run=steps_per_run, box_index=box_index)
            )
        except RuntimeError as error:  # the logs go with the temporary directory
            tails = [f"--- {b.log_path.name}:\n{b.log_tail(12)}" for b in boxes]
            tails += [f"--- {w.log_path.name}:\n{w.log_tail(12)}" for w in workers]
            raise RuntimeError(f"{name}: {error}\n" + "\n".join(tails)) from error
    leaf = summarize_workers(steps, variant.boxes)
    leaf.update(
        placement=variant.placement,
        workers=variant.workers,
        box_count=variant.boxes,
        slots=variant.slots,
        box_slots=np,
        wall_s=round(wall, 2),
        smg_command=smg,
        worker_env={k: v for k, v in env.items() if k != "FUSION_SHARED_STATE_URL"},
    )
    return leaf


def run_workers(args: argparse.Namespace) -> dict[str, Any]:
    """Tokenize, plan and replay every variant of the grid; return the results."""
    started = time.perf_counter()
    threads_n = args.threads[0]
    grid = build_grid(args.workers, boxes=args.boxes, placements=args.placements, spare_at=args.spare_at)
    versions: dict[str, str] = {}
    if any(variant.boxes > 1 for variant in grid):
        from fusion_graph_testing import ensure_smg, smg_version

        versions["smg"] = smg_version(ensure_smg())  # a missing gateway stops the run at once
    shared = any(variant.placement == "shared" for variant in grid)
    if shared:
        from fusion_graph_testing.postgres import PostgresCluster, check_os_user, find_bin_dir

        find_bin_dir()  # and so does a missing Postgres
        check_os_user()
    swe = swe_trajectories(args)
    threads = gateway_threads(swe, threads_n)
    progress(f"{len(swe)} SWE-agent trajectories as {threads_n} threads; {len(grid)} variants")

    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="kv-workers-") as tmp, ExitStack() as stack:
        setup = prepare_server(Path(tmp))
        planned = plan_threads(setup, threads, args.cloud_share)
        plans = [planned.plans[t.thread_id] for t in threads]
        if args.quick:
            plans = [truncate_plan(plan, QUICK_LOCAL_STEPS) for plan in plans]
        progress(
            f"tokenized in {time.perf_counter() - started:.1f} s; longest prompt {planned.longest} tokens"
        )
        cluster = None
        if shared:
            cluster = stack.enter_context(PostgresCluster(prefix="kv-workers-pg-"))
            versions["postgres"] = cluster.version()
        for variant in grid:
            leaf = run_one(
                variant,
                plans,
                setup=setup,
                slot_ctx=planned.slot_ctx,
                steps_per_run=args.steps_per_run,
                cluster=cluster,
                cache_ram=args.cache_ram,
            )
            results[variant.name] = leaf
            progress(
                f"{variant.name} (-np {leaf['box_slots']}): processed {leaf['processed_tokens']:,} minimum "
                f"{leaf['minimum_tokens']:,} = {leaf['processed_over_minimum']}, collisions "
                f"{leaf['slot_collisions']}, moves {leaf['thread_moves']}, threads per box "
                f"{leaf['threads_per_box']} in {leaf['wall_s']:.1f} s"
            )

    meta = {
        "mode": "workers",
        "traces": [str(p) for p in trace_files(args.traces)],
        "quick": args.quick,
        "quick_local_steps": QUICK_LOCAL_STEPS if args.quick else None,
        "trajectories": len(swe),
        "threads": threads_n,
        "steps_per_run": args.steps_per_run,
        "worker_assignment": "thread i's run k (its local steps from k * steps_per_run on) goes to worker "
        "(i + k) % N",
        "steps": planned.steps,
        "cloud_share": args.cloud_share,
        "hysteresis": DEFAULTS["hysteresis"],
        "ctx_per_slot": planned.slot_ctx,
        "longest_prompt_tokens": planned.longest,
        "max_tokens": MAX_TOKENS,
        "llama_server_version": planned.llama_server_version,
        "model": f"tiny random-weight qwen2 (harness write_tiny_model, qwen2 vocab), n_ctx {MODEL_N_CTX}",
        "chat_template": TEMPLATE,
        **versions,
        "box_flags": ["--cache-ram", str(args.cache_ram)],
        "database": "a fresh database per shared variant on one throwaway Postgres cluster",
        "cache_reset": "fresh boxes, gateway, worker processes and database per variant",
        "timing_note": TIMING_NOTE,
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "wall_s": round(time.perf_counter() - started, 1),
    }
    return {"variants": results, "meta": meta}


def check_arguments(args: argparse.Namespace) -> None:
    """Refuse what ``--workers`` cannot run, naming the option (``SystemExit``)."""
    if args.gateway:
        raise SystemExit("--workers and --gateway are separate benchmarks: pick one")
    if len(args.threads) != 1:
        raise SystemExit(f"--threads with --workers: one thread count, got {args.threads}")
    if any(b not in (1, 2) for b in args.boxes):
        raise SystemExit(f"--boxes: 1 or 2, got {list(args.boxes)}")
    if args.steps_per_run < 1:
        raise SystemExit(f"--steps-per-run: at least 1, got {args.steps_per_run}")


def main(args: argparse.Namespace) -> int:
    """Run ``--workers``, print the table and the check, write ``--out``."""
    check_arguments(args)
    result = explained(lambda: run_workers(args), args.traces)
    if result is None:
        return 2
    checks = evaluate_checks(result["variants"])
    result["checks"] = [{"variant": c.variant, "holds": c.holds, "detail": c.detail} for c in checks]
    meta = result["meta"]
    llama = meta["llama_server_version"].removeprefix("version: ")
    print(
        f"KV reuse over worker processes: {meta['trajectories']} SWE-agent trajectories as {meta['threads']} "
        f"threads, runs of {meta['steps_per_run']} local steps round robin over the workers, "
        f"cloud_share {meta['cloud_share']}; llama-server {llama} {' '.join(meta['box_flags'])}"
        + (f", {meta['smg']}" if "smg" in meta else "")
        + (f", Postgres {meta['postgres']}" if "postgres" in meta else "")
    )
    print(format_workers_table(result["variants"]))
    print(f"Check (shared placement <= {SHARED_OVER_MINIMUM:.2f} × minimum):")
    if meta["quick"]:
        print("  (--quick replays each thread's first local steps only: indicative only)")
    print(format_checks(checks))
    print(f"Note: {TIMING_NOTE}")
    print(f"Total wall time {meta['wall_s']} s.")
    write_results(result, args.out)
    return 0
