"""``--gateway``: KV-cache reuse over a pool of llama-server boxes behind a real ``smg`` gateway.

The SWE-agent trajectories are replayed as ``--threads`` concurrent threads
(cycling over the trajectories; a repeat gets a marker at the start of its
first user message, so it shares only the system prompt with the original)
through the graph's own routing, exactly as the one-box benchmark does. Local
steps go to a real ``smg launch`` in front of ``BOXES`` fresh llama-servers,
one fresh pool per variant and thread count:

* ``manual_min_group``: ``--policy manual --assignment-mode min_group
  --routing-key-headers x-fusion-thread``; each request carries
  ``x-fusion-thread: routing_key(thread)`` and ``cache_prompt: true`` (the
  gateway keeps a thread on one box, llama-server picks the slot). The graph
  itself no longer goes through a gateway: it places each thread on a box and
  slot by its lease rule and sends straight to the box (``bench.kv.crowd``
  measures that over two boxes);
* ``cache_aware``: ``--policy cache_aware``, ``cache_prompt: true`` only (the
  gateway picks a box by prefix, llama-server a slot by similarity);
* ``round_robin``: ``--policy round_robin``, ``cache_prompt: true`` only.

The physical minimum is the one-box benchmark's: per thread, the tokens new
since its previous local request, tokenized by a llama-server. Each box runs
``--box-slots`` slots (default ``BOX_SLOTS``). Run ``python -m bench.kv.reuse
--gateway --help``; see bench/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from bench.kv.plan import ThreadPlan
from bench.kv.report import TIMING_NOTE, VERDICT_WORDS, plain_table, progress
from bench.kv.results import StepRecord, over_minimum, step_record, summarize
from bench.kv.server import MAX_TOKENS, MODEL_N_CTX, TEMPLATE, prepare_server
from bench.kv.threads import (
    MODEL_ALIAS,
    REQUEST_TIMEOUT_S,
    box_server,
    gateway_threads,
    plan_threads,
    swe_trajectories,
)
from bench.traces import explained, trace_files, write_results
from fusion_graph.context import DEFAULTS
from fusion_graph.providers.slots import routing_key

if TYPE_CHECKING:
    from fusion_graph_testing import Gateway

#: llama-server boxes behind the gateway.
BOXES = 2
#: ``-np`` of each box unless ``--box-slots`` says otherwise. ``BoxSlots`` keeps the last slot for
#: memory jobs, so 8 conversation slots each: the first requests of 8 threads that start at once
#: get 8 distinct slots, whichever box the gateway puts them on. With fewer, two first requests can
#: share a slot on one box (see bench/README.md).
BOX_SLOTS = 9
#: The request header carrying the routing key.
ROUTING_HEADER = "x-fusion-thread"
#: Threads replayed at once unless ``--threads`` says otherwise.
DEFAULT_THREADS = (8,)
#: Requests over their minimum listed in the results (``excess_detail``), at most.
EXCESS_DETAIL = 20
#: ``manual_min_group`` processes at most this many times the minimum.
TARGET_MANUAL_OVER_MINIMUM = 1.05


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--gateway`` and its own options, on ``bench.kv.reuse``'s parser."""
    parser.add_argument(
        "--gateway",
        action="store_true",
        help=f"replay the SWE-agent traces as --threads threads over {BOXES} llama-server boxes behind a "
        "real smg gateway (variants manual_min_group, cache_aware, round_robin); see bench/kv/gateway.py",
    )
    parser.add_argument(
        "--box-slots",
        type=int,
        default=BOX_SLOTS,
        metavar="N",
        help=f"with --gateway: -np of each box (default {BOX_SLOTS}; BoxSlots keeps the last slot "
        "for memory jobs)",
    )


# -- variants -----------------------------------------------------------------------


@dataclass(frozen=True)
class GatewayVariant:
    """A gateway policy and what a local request carries under it."""

    name: str
    policy: str
    keyed: bool
    description: str

    def gateway_flags(self) -> list[str]:
        """The policy flags of ``smg launch`` (the harness adds host, ports and health checks)."""
        flags = ["--policy", self.policy]
        if self.keyed:
            flags += ["--assignment-mode", "min_group", "--routing-key-headers", ROUTING_HEADER]
        return flags

    def request(self, thread_id: str) -> tuple[dict[str, str], dict[str, Any]]:
        """Headers and extra body fields of a local step of ``thread_id``."""
        if not self.keyed:
            return {}, {"cache_prompt": True}
        return {ROUTING_HEADER: routing_key(thread_id)}, {"cache_prompt": True}


GATEWAY_VARIANTS: tuple[GatewayVariant, ...] = (
    GatewayVariant(
        "manual_min_group",
        "manual",
        True,
        "manual + min_group; x-fusion-thread, cache_prompt, no id_slot",
    ),
    GatewayVariant("cache_aware", "cache_aware", False, "cache_aware; cache_prompt, no header, no id_slot"),
    GatewayVariant("round_robin", "round_robin", False, "round_robin; cache_prompt, no header, no id_slot"),
)
GATEWAY_DEFAULT_VARIANTS = tuple(v.name for v in GATEWAY_VARIANTS)


def choose_variants(text: str) -> list[GatewayVariant]:
    """``--variants`` for ``--gateway``: comma-separated names, in the given order."""
    by_name = {v.name: v for v in GATEWAY_VARIANTS}
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in by_name]
    if unknown or not names:
        raise SystemExit(
            f"--variants with --gateway: {', '.join(unknown) or repr(text)} is not one of {sorted(by_name)}"
        )
    return [by_name[n] for n in dict.fromkeys(names)]


# -- the replay --------------------------------------------------------------------------


@dataclass(frozen=True)
class GatewayStep:
    """One step's cost, its thread and message position, and the box that served it (None: cloud)."""

    record: StepRecord
    thread: str
    position: int
    box: int | None


@dataclass
class GatewayReplay:
    """State shared by the threads of one variant run."""

    client: httpx.AsyncClient
    variant: GatewayVariant
    box_index: Callable[[str | None], int | None]
    steps: list[GatewayStep] = field(default_factory=list)


async def replay_gateway_thread(replay: GatewayReplay, plan: ThreadPlan) -> None:
    """Send one thread's steps in order through the gateway; cloud steps only count."""
    from fusion_graph_testing import served_by

    trajectory = plan.trajectory
    thread = trajectory.thread_id
    for step in plan.steps:
        if step.leg == "cloud":
            replay.steps.append(GatewayStep(step_record(trajectory.file, step), thread, step.position, None))
            continue
        headers, fields = replay.variant.request(thread)
        body = {
            "model": MODEL_ALIAS,
            "messages": list(trajectory.messages[: step.position]),
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            **fields,
        }
        try:
            response = await replay.client.post("/v1/chat/completions", json=body, headers=headers)
        except httpx.TimeoutException as error:
            raise RuntimeError(
                f"{replay.variant.name} {thread} step {step.position} ({fields}): no answer within "
                f"{REQUEST_TIMEOUT_S:.0f} s ({type(error).__name__}); a stuck llama-server? box logs follow"
            ) from error
        if response.status_code != 200:
            raise RuntimeError(
                f"{replay.variant.name} {thread} step {step.position}: HTTP {response.status_code}: "
                f"{response.text[:500]}"
            )
        worker = served_by(response.headers)
        box = replay.box_index(worker)
        if box is None:
            raise RuntimeError(f"{replay.variant.name}: the gateway named no known box ({worker!r})")
        record = step_record(trajectory.file, step, response.json()["timings"])
        replay.steps.append(GatewayStep(record, thread, step.position, box))


async def run_gateway_variant(
    base_url: str,
    variant: GatewayVariant,
    plans: Sequence[ThreadPlan],
    *,
    boxes: Sequence[str],
    box_index: Callable[[str | None], int | None],
    box_slots: int = BOX_SLOTS,
) -> list[GatewayStep]:
    """Replay every thread at once through the gateway, each thread's steps in order."""
    limits = httpx.Limits(max_connections=len(plans) + 2)
    timeout = httpx.Timeout(REQUEST_TIMEOUT_S)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout, limits=limits) as client:
        replay = GatewayReplay(client, variant, box_index)
        await asyncio.gather(*(replay_gateway_thread(replay, plan) for plan in plans))
    return replay.steps


# -- results ------------------------------------------------------------------------------


def box_summary(steps: Sequence[GatewayStep], boxes: int) -> dict[str, Any]:
    """Per box: threads served, requests, tokens; and how often a thread changed box."""
    per_box: list[dict[str, Any]] = [
        {"threads": 0, "requests": 0, "processed_tokens": 0, "cached_tokens": 0} for _ in range(boxes)
    ]
    threads_of: list[set[str]] = [set() for _ in range(boxes)]
    last_box: dict[str, int] = {}
    moves = 0
    for step in steps:
        if step.box is None:
            continue
        entry = per_box[step.box]
        entry["requests"] += 1
        entry["processed_tokens"] += step.record.prompt_n
        entry["cached_tokens"] += step.record.cache_n
        threads_of[step.box].add(step.thread)
        if step.thread in last_box and last_box[step.thread] != step.box:
            moves += 1
        last_box[step.thread] = step.box
    for entry, threads in zip(per_box, threads_of, strict=True):
        entry["threads"] = len(threads)
    on_several = sum(1 for t in last_box if sum(t in s for s in threads_of) > 1)
    excess = [
        {
            "thread": s.thread,
            "position": s.position,
            "box": s.box,
            "prompt_n": s.record.prompt_n,
            "cache_n": s.record.cache_n,
            "minimum": s.record.minimum,
        }
        for s in steps
        if s.box is not None and s.record.prompt_n > s.record.minimum
    ]
    return {
        "boxes": per_box,
        "threads_per_box": [entry["threads"] for entry in per_box],
        "box_moves": moves,
        "threads_on_several_boxes": on_several,
        "excess_detail": excess[:EXCESS_DETAIL],
    }


def summarize_gateway(steps: Sequence[GatewayStep], boxes: int) -> dict[str, Any]:
    """The one-box leaf (``results.summarize``) plus ``processed_over_minimum`` and the boxes."""
    leaf = summarize(s.record for s in steps)
    processed, minimum = leaf["processed_tokens"], leaf["minimum_tokens"]
    leaf["processed_over_minimum"] = round(processed / minimum, 4) if minimum else None
    leaf.update(box_summary(steps, boxes))
    return leaf


@dataclass(frozen=True)
class GatewayTarget:
    """The ``manual_min_group`` target at one thread count."""

    threads: str
    holds: bool | None
    detail: str


def evaluate_gateway_targets(variants: Mapping[str, Mapping[str, Any]]) -> list[GatewayTarget]:
    """``manual_min_group`` processes at most ``TARGET_MANUAL_OVER_MINIMUM`` × the minimum."""
    return [
        GatewayTarget(threads, *over_minimum(leaf, TARGET_MANUAL_OVER_MINIMUM, "target"))
        for threads, leaf in variants.get("manual_min_group", {}).get("threads", {}).items()
    ]


def _fmt(value: Any, key: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, list):
        return " / ".join(_fmt(v) for v in value)
    if isinstance(value, float):
        if key == "wall_s":
            return f"{value:,.1f}"
        return f"{value:.3f}" if value < 10 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


GATEWAY_COLUMNS: tuple[tuple[str, str], ...] = (
    ("local", "local_steps"),
    ("cloud", "cloud_steps"),
    ("processed", "processed_tokens"),
    ("reused", "cached_tokens"),
    ("minimum", "minimum_tokens"),
    ("proc/min", "processed_over_minimum"),
    ("threads per box", "threads_per_box"),
    ("moves", "box_moves"),
    ("prefill ms", "prefill_ms"),
    ("wall s", "wall_s"),
)


def format_gateway_table(variants: Mapping[str, Mapping[str, Any]]) -> str:
    """Plain-text table, one row per variant and thread count."""
    header = ["variant", "thr", *(name for name, _ in GATEWAY_COLUMNS)]
    rows = []
    for name, variant in variants.items():
        for threads, leaf in variant["threads"].items():
            rows.append([name, threads, *(_fmt(leaf.get(key), key) for _, key in GATEWAY_COLUMNS)])
    return plain_table(header, rows, left=2)


def format_gateway_targets(targets: Sequence[GatewayTarget]) -> str:
    """One line per thread count."""
    label = f"manual_min_group <= {TARGET_MANUAL_OVER_MINIMUM:.2f} × minimum"
    return "\n".join(
        f"  {label} threads={t.threads}: {VERDICT_WORDS[t.holds]:<5}  {t.detail}" for t in targets
    )


# -- the run -------------------------------------------------------------------------------


def gateway_server(variant: GatewayVariant, worker_urls: Sequence[str], log: Path) -> Gateway:
    """An ``smg launch`` (not yet started) over ``worker_urls`` with ``variant``'s policy."""
    from fusion_graph_testing import Gateway

    return Gateway(
        worker_urls,
        policy=variant.policy,
        routing_key_header=ROUTING_HEADER if variant.keyed else None,
        assignment_mode="min_group" if variant.keyed else None,
        log_path=log,
    )


def run_gateway(args: argparse.Namespace) -> dict[str, Any]:
    """Tokenize, plan and replay every gateway variant at every thread count; return the results."""
    from fusion_graph_testing import ensure_smg, smg_version

    started = time.perf_counter()
    chosen = choose_variants(args.variants)
    box_slots = int(args.box_slots)
    if box_slots < 2:
        raise SystemExit("--box-slots: at least 2 (BoxSlots keeps one slot per box for memory jobs)")
    smg = ensure_smg()  # before the slow part: a missing gateway stops the run at once
    swe = swe_trajectories(args)
    hysteresis = DEFAULTS["hysteresis"]
    threads_by_level = {level: gateway_threads(swe, level) for level in args.threads}
    progress(f"{len(swe)} SWE-agent trajectories")

    results: dict[str, Any] = {}
    commands: dict[str, list[str]] = {}
    with tempfile.TemporaryDirectory(prefix="kv-gateway-") as tmp:
        setup = prepare_server(Path(tmp))
        planned = plan_threads(setup, [t for ts in threads_by_level.values() for t in ts], args.cloud_share)
        plans, longest, slot_ctx = planned.plans, planned.longest, planned.slot_ctx
        version = planned.llama_server_version
        progress(f"tokenized in {time.perf_counter() - started:.1f} s; longest prompt {longest} tokens")

        for variant in chosen:
            entry: dict[str, Any] = {
                "description": variant.description,
                "gateway_flags": variant.gateway_flags(),
                "threads": {},
            }
            for level, threads in threads_by_level.items():
                name = f"{variant.name}-t{level}"
                with ExitStack() as stack:  # fresh boxes and gateway per run; all stopped, also on failure
                    boxes = [
                        stack.enter_context(
                            box_server(setup, box_slots, slot_ctx * box_slots, f"{name}-box{i}")
                        )
                        for i in range(BOXES)
                    ]
                    gateway = gateway_server(
                        variant, [b.base_url for b in boxes], setup.logs / f"{name}-smg.log"
                    )
                    stack.enter_context(gateway)
                    commands[variant.name] = gateway.args()[1:]
                    t0 = time.perf_counter()
                    try:
                        steps = asyncio.run(
                            run_gateway_variant(
                                gateway.base_url,
                                variant,
                                [plans[t.thread_id] for t in threads],
                                boxes=gateway.worker_urls,
                                box_index=gateway.worker_index,
                                box_slots=box_slots,
                            )
                        )
                    except RuntimeError as error:  # the logs go with the temporary directory
                        tails = "\n".join(f"--- {b.log_path.name}:\n{b.log_tail(12)}" for b in boxes)
                        raise RuntimeError(f"{error}\n{tails}") from error
                    wall = time.perf_counter() - t0
                leaf = summarize_gateway(steps, BOXES)
                leaf["wall_s"] = round(wall, 2)
                entry["threads"][str(level)] = leaf
                progress(
                    f"{name}: processed {leaf['processed_tokens']:,} minimum {leaf['minimum_tokens']:,} "
                    f"threads per box {leaf['threads_per_box']} in {wall:.1f} s"
                )
            results[variant.name] = entry

    meta = {
        "mode": "gateway",
        "traces": [str(p) for p in trace_files(args.traces)],
        "quick": args.quick,
        "trajectories": len(swe),
        "threads": list(args.threads),
        "thread_copies": "thread i replays SWE trajectory i mod n; copy k >= 1 has '[copy k] ' "
        "prepended to its first user message (it shares the system prompt only)",
        "steps": planned.steps,
        "cloud_share": args.cloud_share,
        "hysteresis": hysteresis,
        "boxes": BOXES,
        "box_slots": box_slots,
        "ctx_per_slot": slot_ctx,
        "ctx_size_per_box": slot_ctx * box_slots,
        "longest_prompt_tokens": longest,
        "max_tokens": MAX_TOKENS,
        "smg": smg_version(smg),
        "smg_commands": commands,
        "llama_server_version": version,
        "model": f"tiny random-weight qwen2 (harness write_tiny_model, qwen2 vocab), n_ctx {MODEL_N_CTX}",
        "chat_template": TEMPLATE,
        "cache_reset": "fresh llama-server boxes and a fresh gateway per variant and thread count",
        "timing_note": TIMING_NOTE,
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "wall_s": round(time.perf_counter() - started, 1),
    }
    return {"variants": results, "meta": meta}


def main(args: argparse.Namespace) -> int:
    """Run ``--gateway``, print the table and the target, write ``--out``."""
    result = explained(lambda: run_gateway(args), args.traces)
    if result is None:
        return 2
    targets = evaluate_gateway_targets(result["variants"])
    result["targets"] = [{"threads": t.threads, "holds": t.holds, "detail": t.detail} for t in targets]
    meta = result["meta"]
    print(
        f"KV reuse through a gateway: {meta['trajectories']} SWE-agent trajectories as "
        f"{','.join(map(str, meta['threads']))} threads, {meta['boxes']} boxes × -np {meta['box_slots']} "
        f"-c {meta['ctx_size_per_box']} ({meta['llama_server_version']}), {meta['smg']}, "
        f"cloud_share {meta['cloud_share']}"
    )
    print(format_gateway_table(result["variants"]))
    print("Target:")
    if meta["quick"]:
        print("  (--quick replays a subset: indicative only)")
    print(format_gateway_targets(targets))
    print(f"Note: {TIMING_NOTE}")
    print(f"Total wall time {meta['wall_s']} s.")
    write_results(result, args.out)
    return 0
