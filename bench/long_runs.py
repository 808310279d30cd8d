"""Long runs on a real llama-server: no step overflows a window, and the estimate counts like the server.

Every trajectory of the shared traces is replayed as one thread on a real llama-server whose slots
hold 8,192 tokens, through the graph's own routing (``turn.next_route``) and
its own sizing (``nodes.step.Sizer``: windows from ``GET /props`` and the cloud model's profile,
per-leg anchors on the servers' reports, llama-server's count of a thread's first local request,
the fit rule and compaction). Local steps go to llama-server (``max_tokens`` 1: the recorded
answer replaces the generated one, while the fit rule reserves the full ``max_completion_tokens``);
cloud steps go to a stand-in that reports the prompt as the same server tokenizes it.

    python -m bench.long_runs                         # all traces, both cloud windows (about 2 min)
    python -m bench.long_runs --quick --out long.json
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

import httpx
from langchain_core.messages import AIMessage, AnyMessage, BaseMessage, convert_to_openai_messages
from langchain_core.messages.utils import count_tokens_approximately
from langchain_openai import ChatOpenAI
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from bench.kv.plan import new_token_counts
from bench.kv.server import N_SLOTS, prepare_server, server_version
from bench.traces import DEFAULT_TRACES, QUICK_OTHER, QUICK_SWE, is_swe_file
from fusion_graph.context import FusionContext
from fusion_graph.errors import TraceError
from fusion_graph.nodes.step import Sizer
from fusion_graph.nodes.tools import batch_notice
from fusion_graph.providers.chain import ProviderChain
from fusion_graph.providers.llama_server import ChatLlamaServer, count_prompt_tokens
from fusion_graph.providers.placement import slot_body
from fusion_graph.providers.resolver import ProviderResolver
from fusion_graph.providers.slots import SlotPool
from fusion_graph.replay.history import split_system
from fusion_graph.replay.traces import RecordedTrajectory, load_trajectories
from fusion_graph.routing.score import DEFAULT_CLOUD_SHARE, Leg
from fusion_graph.settings import FusionSettings
from fusion_graph.sizing.turn import approximate_tokens, build_prompt, next_route, turn_start
from fusion_graph.state import PromptAnchor, State

#: Tokens one llama-server slot holds in this benchmark.
SLOT_WINDOW = 8192
#: The cloud model the stand-in plays (its langchain-core profile gives the default cloud window).
CLOUD_MODEL = "gpt-4o"
#: Targets: estimator error on local steps, overflow errors, prefill against the minimum.
TARGET_MEDIAN, TARGET_P95, TARGET_PREFILL = 0.03, 0.08, 1.10


@dataclass
class StepRecord:
    """One replayed step."""

    file: str
    routed: Leg
    leg: Leg | None
    fit_escalation: bool = False
    compacted: bool = False
    overflow: bool = False
    estimate: int | None = None
    basis: str | None = None
    baseline: int | None = None
    reported: int | None = None
    prompt_n: int = 0
    minimum: int = 0


@dataclass
class Thread:
    """A trajectory as the graph's state would hold it while it is replayed."""

    trajectory: RecordedTrajectory
    history: list[BaseMessage] = field(default_factory=list)
    anchors: dict[str, PromptAnchor] = field(default_factory=dict)
    leg: Leg | None = None
    notice: bool = False
    tokens: list[list[int]] = field(default_factory=list)


def thread_of(trajectory: RecordedTrajectory) -> str:
    """A thread id unique per trace record."""
    return f"{trajectory.file}:{trajectory.line}:{trajectory.id}"


async def render_tokens(client: httpx.AsyncClient, messages: list[dict[str, Any]]) -> list[int]:
    """The tokens llama-server makes of a chat request (template, then tokenizer)."""
    prompt = (await client.post("/apply-template", json={"messages": messages})).json()["prompt"]
    body = {"content": prompt, "add_special": True, "parse_special": True}
    tokens: list[int] = (await client.post("/tokenize", json=body)).json()["tokens"]
    return tokens


class Replayer:
    """Replays threads on one server through the graph's routing and sizing."""

    def __init__(self, base_url: str, chain: ProviderChain, sizer: Sizer, context: FusionContext) -> None:
        self.base_url, self.chain, self.sizer, self.context = base_url, chain, sizer, context
        self.pool = SlotPool(N_SLOTS, reserve_reflection=False)
        self.client = httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(600.0))

    async def step(self, thread: Thread, message: AIMessage, context: FusionContext) -> StepRecord:
        """Route, size and send the step that ``message`` answered; then append it to the history."""
        history = thread.history
        in_turn = history[turn_start(history) + 1 :]
        step = sum(isinstance(m, AIMessage) for m in in_turn)
        state: State = {
            "messages": cast(list[AnyMessage], history),
            "step": step - 1,
            "notice": thread.notice,
        }
        if thread.leg is not None and step > 0:
            state["leg"] = thread.leg
        sizes = await self.sizer.measure(self.chain, history, thread.anchors, context)
        decision, _ = next_route(
            state, context, plan=step == 0, prompt_tokens=sizes.score_tokens, budget=sizes.budget
        )
        prepared = await self.sizer.prepare(
            self.chain, decision.leg, history, thread.anchors, context, sizes=sizes
        )
        record = StepRecord(thread.trajectory.file, decision.leg, None)
        if prepared.compactions:
            history, record.compacted = list(prepared.messages), True
        allowed = [link for link in self.chain.links if link.id in prepared.plan.allowed]
        start = next((link for link in allowed if link.leg == decision.leg), allowed[0] if allowed else None)
        record.fit_escalation = start is not None and start.leg != decision.leg
        sent = convert_to_openai_messages(build_prompt(context.system_prompt, history))
        local = prepared.sizes.estimates.get("local")
        if start is not None and start.leg == "local" and local is not None:
            record.estimate, record.basis = local.tokens, local.basis
            record.baseline = count_tokens_approximately(build_prompt(context.system_prompt, history))
            answered = await self._local(thread, sent, record)
            if not answered:
                start = next((link for link in allowed if link.leg == "cloud"), None)
        if start is not None and start.leg == "cloud":
            record.leg = "cloud"
            record.reported = await count_prompt_tokens(self.base_url, sent, client=self.client)
        if record.leg is not None:
            thread.anchors = prepared.anchors(thread.anchors, record.leg, record.reported, record.leg)
        thread.leg = record.leg or decision.leg
        thread.notice = batch_notice(
            message,
            earlier_in_turn=in_turn,
            max_calls=context.max_tool_calls_per_step,
            loop_repeat_limit=context.loop_repeat_limit,
        )
        thread.history = [*history, message]
        return record

    async def _local(self, thread: Thread, sent: list[dict[str, Any]], record: StepRecord) -> bool:
        """Send a local step; ``False`` when llama-server refused it for its size (an overflow)."""
        slot = slot_body("local", self.pool.slot_for(thread_of(thread.trajectory)))
        body = {"messages": sent, "max_tokens": 1, "temperature": 0, **(slot or {})}
        response = await self.client.post("/v1/chat/completions", json=body)
        if response.status_code == 400 and "exceed_context_size_error" in response.text:
            record.overflow = True
            return False
        response.raise_for_status()
        data = response.json()
        record.leg, record.reported = "local", int(data["usage"]["prompt_tokens"])
        record.prompt_n = int(data["timings"]["prompt_n"])
        tokens = await render_tokens(self.client, sent)
        record.minimum = new_token_counts([thread.tokens[-1], tokens] if thread.tokens else [tokens])[-1]
        thread.tokens.append(tokens)
        return True

    async def thread(self, trajectory: RecordedTrajectory) -> list[StepRecord]:
        """Replay one trajectory as one thread."""
        system, body = split_system(trajectory.messages)
        context = dataclasses.replace(self.context, system_prompt=system) if system else self.context
        thread = Thread(trajectory)
        records = []
        for index, message in enumerate(body):
            message = message.model_copy(update={"id": f"{trajectory.line}-{index}"})
            if isinstance(message, AIMessage):
                records.append(await self.step(thread, message, context))
            else:
                thread.history.append(message)
        self.pool.release(thread_of(trajectory))
        return records


def asdict_context(context: FusionContext) -> dict[str, Any]:
    """A context's fields as keyword arguments."""
    return {name: getattr(context, name) for name in FusionContext.__dataclass_fields__}


def quantile(values: Sequence[float], q: float) -> float | None:
    """The ``q`` quantile (nearest rank) of ``values``, ``None`` when empty."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]


def summarize(records: Sequence[StepRecord]) -> dict[str, Any]:
    """Counts, estimator errors and prefill of a set of steps."""
    local = [r for r in records if r.leg == "local" and r.reported and r.estimate is not None]
    errors = [
        abs(r.estimate - r.reported) / r.reported for r in local if r.estimate is not None and r.reported
    ]
    baseline = [abs(r.baseline - r.reported) / r.reported for r in local if r.baseline and r.reported]
    anchored = [
        abs(r.estimate - r.reported) / r.reported
        for r in local
        if r.basis == "anchored" and r.estimate is not None and r.reported
    ]
    processed, minimum = sum(r.prompt_n for r in local), sum(r.minimum for r in local)
    return {
        "steps": len(records),
        "local_steps": len(local),
        "cloud_steps": sum(r.leg == "cloud" for r in records),
        "fit_escalations": sum(r.fit_escalation for r in records),
        "compactions": sum(r.compacted for r in records),
        "overflow_errors": sum(r.overflow for r in records),
        "estimator_median": statistics.median(errors) if errors else None,
        "estimator_p95": quantile(errors, 0.95),
        "estimator_max": max(errors, default=None),
        "anchored_median": statistics.median(anchored) if anchored else None,
        "anchored_steps": len(anchored),
        "server_counted_steps": sum(r.basis == "server" for r in local),
        "baseline_median": statistics.median(baseline) if baseline else None,
        "baseline_p95": quantile(baseline, 0.95),
        "processed_tokens": processed,
        "minimum_tokens": minimum,
        "prefill_ratio": round(processed / minimum, 4) if minimum else None,
    }


async def replay_all(
    base_url: str,
    trajectories: Sequence[RecordedTrajectory],
    settings: FusionSettings,
    context: FusionContext,
) -> list[StepRecord]:
    """Replay every trajectory, one thread after the other, with a progress bar on stderr."""
    cloud = ChatOpenAI(model=CLOUD_MODEL, api_key="unused", base_url="http://127.0.0.1:9/v1")
    local = ChatLlamaServer(model="tiny", api_key="unused", base_url=base_url + "/v1")
    resolver = ProviderResolver(cloud=cloud, local=local, settings=settings)
    chain = await resolver.chain(context)
    replayer = Replayer(base_url, chain, Sizer(resolver, [], approximate_tokens), context)
    records: list[StepRecord] = []
    try:
        with Progress(console=Console(stderr=True), transient=True) as progress:
            task = progress.add_task(
                f"cloud window {settings.cloud_window_tokens or 'profile'}", total=len(trajectories)
            )
            for trajectory in trajectories:
                records += await replayer.thread(trajectory)
                progress.advance(task)
    finally:
        await replayer.client.aclose()
        await resolver.aclose()
    return records


def report(records: Sequence[StepRecord]) -> dict[str, Any]:
    """The summary over all steps and per trace file."""
    files = sorted({r.file for r in records})
    return {
        "all": summarize(records),
        "files": {f: summarize([r for r in records if r.file == f]) for f in files},
    }


def render(results: dict[str, Any], console: Console) -> None:
    """The results as a rich table, then the targets."""
    table = Table(
        title=f"long runs on llama-server, {SLOT_WINDOW:,}-token slots (local steps: estimator error)"
    )
    for column in (
        "cloud window",
        "traces",
        "steps",
        "local",
        "cloud",
        "fit esc.",
        "compactions",
        "overflows",
        "est. median",
        "est. p95",
        "est. worst",
        "chars/4 median",
        "chars/4 p95",
        "prefill / min",
    ):
        table.add_column(column, justify="left" if column in ("cloud window", "traces") else "right")
    for name, entry in results["variants"].items():
        for label, summary in [("all", entry["all"]), *entry["files"].items()]:
            table.add_row(
                name if label == "all" else "",
                label,
                f"{summary['steps']:,}",
                f"{summary['local_steps']:,}",
                f"{summary['cloud_steps']:,}",
                str(summary["fit_escalations"]),
                str(summary["compactions"]),
                str(summary["overflow_errors"]),
                _pct(summary["estimator_median"]),
                _pct(summary["estimator_p95"]),
                _pct(summary["estimator_max"]),
                _pct(summary["baseline_median"]),
                _pct(summary["baseline_p95"]),
                f"{summary['prefill_ratio']:.3f}" if summary["prefill_ratio"] else "-",
            )
    console.print(table)
    for line in results["targets"]:
        console.print(line)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.2f} %"


def targets(results: dict[str, Any]) -> list[str]:
    """One line per target and variant: holds or not, with the numbers."""
    lines = []
    for name, entry in results["variants"].items():
        s = entry["all"]
        checks = [
            (s["overflow_errors"] == 0, f"overflow errors {s['overflow_errors']} (target 0)"),
            (
                s["estimator_median"] is not None and s["estimator_median"] <= TARGET_MEDIAN,
                f"estimator median {_pct(s['estimator_median'])} (target <= {TARGET_MEDIAN:.0%})",
            ),
            (
                s["estimator_p95"] is not None and s["estimator_p95"] <= TARGET_P95,
                f"estimator p95 {_pct(s['estimator_p95'])} (target <= {TARGET_P95:.0%})",
            ),
        ]
        for file, summary in entry["files"].items():
            if is_swe_file(file) and summary["prefill_ratio"] is not None:
                ratio = summary["prefill_ratio"]
                checks.append(
                    (ratio <= TARGET_PREFILL, f"{file} prefill {ratio:.3f} x minimum (target <= 1.10)")
                )
        lines += [f"  cloud window {name}: {'HOLDS' if ok else 'MISSED'}  {text}" for ok, text in checks]
    return lines


def quick(trajectories: Sequence[RecordedTrajectory]) -> list[RecordedTrajectory]:
    """The ``--quick`` subset: the first trajectories of each file (as ``bench.traces.select_quick``)."""
    taken: dict[str, int] = {}
    chosen = []
    for trajectory in trajectories:
        limit = QUICK_SWE if is_swe_file(trajectory.file) else QUICK_OTHER
        if taken.get(trajectory.file, 0) < limit:
            taken[trajectory.file] = taken.get(trajectory.file, 0) + 1
            chosen.append(trajectory)
    return chosen


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--traces", nargs="+", type=Path, default=[DEFAULT_TRACES])
    parser.add_argument("--out", type=Path, help="write the results as JSON")
    parser.add_argument("--quick", action="store_true", help="2 SWE-agent and 3 tau-bench trajectories")
    parser.add_argument(
        "--cloud-windows",
        default=f"profile,{SLOT_WINDOW}",
        help="cloud windows to replay with: 'profile' (the cloud model's, 128,000) and/or token counts",
    )
    parser.add_argument("--cloud-share", type=int, default=DEFAULT_CLOUD_SHARE)
    parser.add_argument("--max-completion-tokens", type=int, default=None, help="default: the context's")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    err = Console(stderr=True)
    try:
        trajectories = load_trajectories(args.traces)
    except TraceError as error:
        err.print(f"[red]{error}[/red]")
        return 2
    if args.quick:
        trajectories = quick(trajectories)
    overrides: dict[str, Any] = {"cloud_share": args.cloud_share, "sub_runners": "off"}
    if args.max_completion_tokens is not None:
        overrides["max_completion_tokens"] = args.max_completion_tokens
    context = FusionContext(**overrides)
    started = time.perf_counter()
    results: dict[str, Any] = {"variants": {}}
    with tempfile.TemporaryDirectory(prefix="long-runs-") as tmp:
        setup = prepare_server(Path(tmp))
        props: dict[str, Any] = {}
        for window in [w.strip() for w in args.cloud_windows.split(",") if w.strip()]:
            settings = FusionSettings(cloud_window_tokens=0 if window == "profile" else int(window))
            server = setup.server(n_slots=N_SLOTS, ctx_size=N_SLOTS * SLOT_WINDOW, name=f"long-runs-{window}")
            with server:  # a fresh process per run: no KV or prompt cache carries over
                props = server.props()
                records = asyncio.run(replay_all(server.base_url, trajectories, settings, context))
            results["variants"][window] = {**report(records), "steps": [asdict(r) for r in records]}
        results["meta"] = {
            "server": server_version(server.binary),
            "slot_window": props["default_generation_settings"]["n_ctx"],
            "total_slots": props["total_slots"],
            "trajectories": len(trajectories),
            "context": {k: v for k, v in asdict_context(context).items() if k != "system_prompt"},
            "wall_s": round(time.perf_counter() - started, 1),
        }
    results["targets"] = targets(results)
    out = Console()
    render(results, out if out.is_terminal else Console(width=220))
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
