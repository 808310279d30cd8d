"""What the multi-box benchmarks (``--gateway``, ``--workers``) share: the threads and their plans.

``gateway_threads`` turns the SWE-agent trajectories (``swe_trajectories``) into
``--threads`` distinct conversations (a repeat gets ``[copy N]`` at the start of its
first user message, ``mark_copy``); ``plan_threads`` routes and tokenizes them once
for every variant; ``box_server`` configures one llama-server box serving the model
as ``MODEL_ALIAS``. ``bench.kv.gateway`` and ``bench.kv.workers`` replay them.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from bench.kv.plan import ThreadPlan, plan_thread, route_trajectory
from bench.kv.report import progress
from bench.kv.server import ServerSetup, per_slot_ctx, tokenize_requests
from bench.kv.server import server_version as llama_server_version
from bench.traces import Trajectory, load_traces, select_quick
from fusion_graph.context import DEFAULTS

if TYPE_CHECKING:
    from fusion_graph_testing import LlamaServer

#: The served model id (``--alias``) every request names.
MODEL_ALIAS = "local"

#: Seconds one local request may take (the longest prefill here takes seconds) before the run fails.
REQUEST_TIMEOUT_S = 300.0


def mark_copy(messages: Sequence[Mapping[str, Any]], copy: int) -> tuple[dict[str, Any], ...]:
    """The messages with ``[copy N]`` at the start of the first user message (copy 0: unchanged)."""
    marked = [dict(m) for m in messages]
    if copy == 0:
        return tuple(marked)
    tag = f"[copy {copy}] "
    for message in marked:
        if message.get("role") != "user":
            continue
        content = message.get("content")
        if isinstance(content, str):
            message["content"] = tag + content
        elif isinstance(content, list):
            message["content"] = [{"type": "text", "text": tag}, *content]
        else:
            message["content"] = tag
        break
    return tuple(marked)


def gateway_threads(trajectories: Sequence[Trajectory], count: int) -> list[Trajectory]:
    """``count`` threads cycling over ``trajectories``; each repeat is a distinct conversation."""
    if not trajectories:
        raise ValueError("no trajectories to replay")
    threads = []
    for index in range(count):
        base = trajectories[index % len(trajectories)]
        copy = index // len(trajectories)
        if copy == 0:
            threads.append(base)
        else:
            trace_id = f"{base.trace_id}#copy{copy}"
            threads.append(Trajectory(base.file, base.line, trace_id, mark_copy(base.messages, copy)))
    return threads


# -- boxes and plans ----------------------------------------------------------------


def box_server(
    setup: ServerSetup, n_slots: int, ctx_size: int, name: str, extra_args: Sequence[str] = ()
) -> LlamaServer:
    """A box (not yet started): the tiny model, ``--alias local``, ``extra_args``; log ``logs/name.log``."""
    from fusion_graph_testing import LlamaServer

    return LlamaServer(
        setup.model,
        n_slots=n_slots,
        ctx_size=ctx_size,
        jinja=True,
        extra_args=["--chat-template-file", str(setup.template), "--alias", MODEL_ALIAS, *extra_args],
        log_path=setup.logs / f"{name}.log",
    )


def swe_trajectories(args: argparse.Namespace) -> list[Trajectory]:
    """The SWE-agent trajectories of ``--traces`` (``--quick``: its subset); ``SystemExit`` when none."""
    trajectories = load_traces(args.traces)
    if args.quick:
        trajectories = select_quick(trajectories)
    swe = [t for t in trajectories if t.is_swe]
    if not swe:
        raise SystemExit(
            "this benchmark replays the SWE-agent traces (files named swe*); none found in --traces"
        )
    return swe


@dataclass(frozen=True)
class PlannedThreads:
    """Every distinct thread's plan, and what sizing the boxes needs."""

    plans: dict[str, ThreadPlan]
    steps: int
    longest: int
    slot_ctx: int
    llama_server_version: str


def plan_threads(setup: ServerSetup, threads: Iterable[Trajectory], cloud_share: int) -> PlannedThreads:
    """Route each distinct thread's steps (default hysteresis), tokenize them on a llama-server, plan them."""
    hysteresis = DEFAULTS["hysteresis"]
    distinct = {t.thread_id: t for t in threads}
    routed = {
        tid: route_trajectory(t.messages, hysteresis=hysteresis, cloud_share=cloud_share)
        for tid, t in distinct.items()
    }
    requests = [(tid, r.position) for tid, steps in routed.items() for r in steps]
    progress(f"{len(distinct)} threads, {len(requests)} steps")
    tokenizer = setup.server(n_slots=1, ctx_size=4096, name="tokenize")
    with tokenizer:
        version = llama_server_version(tokenizer.binary)
        tokens_flat = asyncio.run(
            tokenize_requests(
                tokenizer.base_url, [distinct[tid].messages[:position] for tid, position in requests]
            )
        )
    tokens = dict(zip(requests, tokens_flat, strict=True))
    longest = max((len(tok) for tok in tokens_flat), default=1)
    plans = {
        tid: plan_thread(distinct[tid], steps, [tokens[(tid, r.position)] for r in steps])
        for tid, steps in routed.items()
    }
    return PlannedThreads(plans, len(requests), longest, per_slot_ctx(longest), version)
