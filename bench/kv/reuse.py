"""KV-cache reuse of fusion routing on a real llama-server, replayed from agent traces.

Each trajectory in the traces is one conversation (one thread). Its assistant
messages are its steps; the request of a step is the history before that
assistant message. Every step is routed with the project's own
``score_step``/``decide_leg`` (mode ``fusion``, cloud_share 30), tracking the
leg per thread exactly like the graph does. Local steps are sent to a real
llama-server (``max_tokens: 1``, ``temperature: 0``) serving a generated tiny
qwen2 model; cloud steps go to a stand-in that only counts their tokens.

Three variants, each on a freshly started server (so no cache survives from
the previous run), at each concurrency level:

* ``fusion``: ``id_slot`` from a ``SlotPool`` plus ``cache_prompt: true``,
  default hysteresis (what the graph sends);
* ``hazard``: no ``id_slot`` and ``cache_prompt: false``, same routing;
* ``no_hysteresis``: slot affinity as in ``fusion`` but hysteresis 0.

The physical minimum of a local request is what is new since the same
thread's previous local request: every request is rendered by the server
(``POST /apply-template``) and tokenized (``POST /tokenize``), and the minimum
is ``len(tokens) - LCP(tokens, previous local tokens)``.

This module is the entry point (arguments, one fresh server per run, the
results JSON); the pieces live in ``bench.traces``, ``bench.kv.plan``,
``bench.kv.server``, ``bench.kv.replay``, ``bench.kv.results`` and
``bench.kv.report``; ``--gateway`` (two boxes behind a real smg gateway) lives in
``bench.kv.gateway`` and ``--workers`` (a thread's runs on different worker processes)
in ``bench.kv.workers`` (its results in ``bench.kv.workers_results``), both replaying the
threads of ``bench.kv.threads``. Run ``python -m bench.kv.reuse --help``; see bench/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.kv import gateway, workers
from bench.kv.gateway import DEFAULT_THREADS as GATEWAY_DEFAULT_THREADS
from bench.kv.gateway import GATEWAY_DEFAULT_VARIANTS
from bench.kv.plan import CLOUD_SHARE, ThreadPlan, plan_thread, route_trajectory
from bench.kv.replay import DEFAULT_VARIANTS, VARIANTS, run_variant
from bench.kv.report import CLOUD_COUNT_NOTE, TIMING_NOTE, format_table, format_targets, progress
from bench.kv.results import evaluate_targets, summarize_with_files
from bench.kv.server import (
    MAX_TOKENS,
    MODEL_N_CTX,
    N_SLOTS,
    TEMPLATE,
    per_slot_ctx,
    prepare_server,
    server_version,
    tokenize_requests,
)
from bench.traces import (
    add_trace_arguments,
    assistant_positions,
    explained,
    load_traces,
    select_quick,
    trace_files,
    write_results,
)
from fusion_graph.context import DEFAULTS


def parse_threads(text: str) -> list[int]:
    """``"1,4"`` -> ``[1, 4]``."""
    try:
        levels = [int(part) for part in text.split(",") if part.strip()]
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from error
    if not levels or any(level < 1 for level in levels):
        raise argparse.ArgumentTypeError(f"concurrency levels must be >= 1, got {text!r}")
    return levels


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.kv.reuse",
        description="KV-cache reuse of fusion routing on a real llama-server, replayed from agent traces.",
    )
    add_trace_arguments(parser)
    parser.add_argument(
        "--threads",
        type=parse_threads,
        default=None,
        help="concurrency levels, comma-separated (default: 1,4; with --gateway: threads replayed at once, "
        f"default {','.join(map(str, GATEWAY_DEFAULT_THREADS))}; with --workers: one count, "
        f"default {workers.THREADS})",
    )
    parser.add_argument(
        "--variants",
        default=None,
        help="comma-separated, any of: "
        + ", ".join(v.name for v in VARIANTS)
        + f" (default: {','.join(DEFAULT_VARIANTS)}); with --gateway any of: "
        + ", ".join(GATEWAY_DEFAULT_VARIANTS)
        + " (default: all)",
    )
    gateway.add_arguments(parser)  # --gateway, --box-slots
    workers.add_arguments(parser)  # --workers, --placements, --boxes, --spare-at, --steps-per-run
    parser.add_argument(
        "--cloud-share",
        type=int,
        default=CLOUD_SHARE,
        choices=range(101),
        metavar="0-100",
        help=f"the routing dial (default {CLOUD_SHARE}, what the targets are stated for)",
    )
    parser.add_argument(
        "--keep-threads",
        action="store_true",
        help="never release a finished thread's slot (the graph never calls SlotPool.release); "
        "by default a finished trajectory releases its slot",
    )
    args = parser.parse_args(argv)
    if args.threads is None:
        if args.workers:
            args.threads = [workers.THREADS]
        else:
            args.threads = list(GATEWAY_DEFAULT_THREADS) if args.gateway else [1, 4]
    if args.variants is None:
        args.variants = ",".join(GATEWAY_DEFAULT_VARIANTS if args.gateway else DEFAULT_VARIANTS)
    return args


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Tokenize, plan and replay every variant at every concurrency level; return the results."""
    started = time.perf_counter()
    chosen = [v for v in VARIANTS if v.name in {n.strip() for n in args.variants.split(",")}]
    if not chosen:
        raise SystemExit(f"--variants: none of {args.variants!r} is one of {[v.name for v in VARIANTS]}")
    trajectories = load_traces(args.traces)
    if args.quick:
        trajectories = select_quick(trajectories)
    requests = [
        (t, p) for t in trajectories for p in assistant_positions(t.messages)
    ]  # every step: local ones for the minimum, cloud ones for the stand-in count
    progress(f"{len(trajectories)} trajectories, {len(requests)} steps")

    with tempfile.TemporaryDirectory(prefix="kv-reuse-") as tmp:
        setup = prepare_server(Path(tmp))
        tokenizer = setup.server(n_slots=1, ctx_size=4096, name="tokenize")
        with tokenizer:
            version = server_version(tokenizer.binary)
            binary = str(tokenizer.binary)
            tokens_flat = asyncio.run(
                tokenize_requests(tokenizer.base_url, [t.messages[:p] for t, p in requests])
            )
        tokens = {(t.thread_id, p): tok for (t, p), tok in zip(requests, tokens_flat, strict=True)}
        longest = max((len(tok) for tok in tokens_flat), default=1)
        slot_ctx = per_slot_ctx(longest)
        progress(f"tokenized in {time.perf_counter() - started:.1f} s; longest prompt {longest} tokens")

        plans_by_h: dict[int, list[ThreadPlan]] = {}
        for h in sorted({v.hysteresis for v in chosen}):
            plans_by_h[h] = []
            for t in trajectories:
                routed = route_trajectory(t.messages, hysteresis=h, cloud_share=args.cloud_share)
                prompts = [tokens[(t.thread_id, r.position)] for r in routed]
                plans_by_h[h].append(plan_thread(t, routed, prompts))

        results: dict[str, Any] = {}
        slots_seen: dict[str, Any] = {}
        for variant in chosen:
            entry: dict[str, Any] = {
                "hysteresis": variant.hysteresis,
                "description": variant.description,
                "threads": {},
            }
            for level in args.threads:
                name = f"{variant.name}-t{level}"
                server = setup.server(n_slots=N_SLOTS, ctx_size=slot_ctx * N_SLOTS, name=name)
                with server:  # a fresh process per run: no KV or prompt cache carries over
                    slots_seen = {"total_slots": server.props()["total_slots"]}
                    slots_seen["n_ctx_per_slot"] = sorted({s["n_ctx"] for s in server.slots()})
                    t0 = time.perf_counter()
                    records = asyncio.run(
                        run_variant(
                            server.base_url,
                            variant,
                            plans_by_h[variant.hysteresis],
                            level,
                            release=not args.keep_threads,
                        )
                    )
                    wall = time.perf_counter() - t0
                leaf = summarize_with_files(records)
                leaf["wall_s"] = round(wall, 2)
                entry["threads"][str(level)] = leaf
                progress(
                    f"{name}: processed {leaf['processed_tokens']:,} minimum {leaf['minimum_tokens']:,} "
                    f"in {wall:.1f} s"
                )
            results[variant.name] = entry

    files = {t.file for t in trajectories}
    legs_by_h = {
        str(h): [s.leg for plan in plans for s in plan.steps] for h, plans in sorted(plans_by_h.items())
    }
    routed_differently = sum(len(set(legs)) > 1 for legs in zip(*legs_by_h.values(), strict=True))
    steps_over_limit = sum(
        1 for plan in plans_by_h[min(plans_by_h)] for s in plan.steps if s.step >= DEFAULTS["max_steps"]
    )
    meta = {
        "traces": [str(p) for p in trace_files(args.traces)],
        "quick": args.quick,
        "trajectories": len(trajectories),
        "trajectories_per_file": {f: sum(t.file == f for t in trajectories) for f in sorted(files)},
        "steps": len(requests),
        "steps_at_or_past_max_steps": steps_over_limit,
        "mode": "fusion",
        "cloud_share": args.cloud_share,
        "legs_by_hysteresis": {
            h: {leg: legs.count(leg) for leg in ("local", "cloud")} for h, legs in legs_by_h.items()
        },
        "steps_routed_differently_across_hysteresis": routed_differently,
        "default_hysteresis": DEFAULTS["hysteresis"],
        "max_steps": DEFAULTS["max_steps"],
        "conversation_max_tokens": DEFAULTS["conversation_max_tokens"],
        "notice": False,
        "release_finished_threads": not args.keep_threads,
        "llama_server": binary,
        "llama_server_version": version,
        "model": f"tiny random-weight qwen2 (harness write_tiny_model, qwen2 vocab), n_ctx {MODEL_N_CTX}",
        "chat_template": TEMPLATE,
        "n_slots": N_SLOTS,
        "ctx_size": slot_ctx * N_SLOTS,
        "ctx_per_slot": slot_ctx,
        "server_slots": slots_seen,
        "longest_prompt_tokens": longest,
        "max_tokens": MAX_TOKENS,
        "cache_reset": "a fresh llama-server process per variant and concurrency level",
        "cloud_token_count": CLOUD_COUNT_NOTE,
        "timing_note": TIMING_NOTE,
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "wall_s": round(time.perf_counter() - started, 1),
    }
    return {"variants": results, "meta": meta}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.workers:
        return workers.main(args)
    if args.gateway:
        return gateway.main(args)
    result = explained(lambda: run(args), args.traces)
    if result is None:
        return 2
    targets = evaluate_targets(result["variants"])
    result["targets"] = [
        {"target": t.name, "threads": t.threads, "holds": t.holds, "detail": t.detail} for t in targets
    ]
    meta = result["meta"]
    print(
        f"KV reuse: {meta['trajectories']} trajectories, {meta['steps']} steps, mode fusion, "
        f"cloud_share {meta['cloud_share']}, llama-server -np {meta['n_slots']} -c {meta['ctx_size']} "
        f"({meta['llama_server_version']})"
    )
    print(format_table(result["variants"]))
    print("Targets (SWE-agent traces):")
    if meta["quick"]:
        print("  (--quick replays a subset: indicative only; the targets are judged on the full SWE file)")
    if meta["cloud_share"] != CLOUD_SHARE:
        print(
            f"  (the targets are stated for cloud_share {CLOUD_SHARE}; this run used {meta['cloud_share']})"
        )
    print(format_targets(targets))
    print(f"Note: {TIMING_NOTE}")
    print(f"Cloud steps: {CLOUD_COUNT_NOTE}.")
    print(f"Total wall time {meta['wall_s']} s.")
    write_results(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
