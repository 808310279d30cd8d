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

Run ``python -m bench.kv_reuse --help``; see bench/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from array import array
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
from langchain_core.messages import convert_to_messages

from fusion_graph.context import DEFAULTS, FusionContext
from fusion_graph.replay import route_history
from fusion_graph.routing import DEFAULT_CLOUD_SHARE, Leg
from fusion_graph.slots import SlotPool, slot_body

if TYPE_CHECKING:
    from fusion_graph.testing import LlamaServer

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TRACES = REPO_ROOT.parent / "shared" / "data" / "traces"

#: ``-np`` of the benchmark server (explicit, so every slot has its own KV cache).
N_SLOTS = 4
#: The routing dial the targets are stated for.
CLOUD_SHARE = DEFAULT_CLOUD_SHARE
#: A tool-capable template matching the qwen2 vocab (renders tool_calls and tool messages).
TEMPLATE = "Qwen-Qwen2.5-7B-Instruct"
#: Training context written into the tiny model; the per-slot context must not exceed it.
MODEL_N_CTX = 131072
#: Room above the longest prompt in each slot (the one generated token, rounding).
CTX_MARGIN = 64
#: Tokens sent per local request beyond the prompt.
MAX_TOKENS = 1

#: ``--quick``: this many trajectories from each SWE-agent file, ``QUICK_OTHER`` from each other file.
QUICK_SWE = 2
QUICK_OTHER = 3

#: Targets, judged on the SWE-agent traces.
TARGET_FUSION_OVER_MINIMUM = 1.10
TARGET_HAZARD_OVER_FUSION = 5.0

TIMING_NOTE = (
    "Timing figures (prefill ms, wall s) come from one tiny random-weight model on this machine: "
    "compare them within one run only, never across runs or machines."
)
CLOUD_COUNT_NOTE = (
    "cloud steps are not sent anywhere; their prompt is rendered by llama-server (/apply-template) "
    "and counted with its tokenizer (/tokenize), the same tokens the minimum uses; "
    "cloud_prompt_tokens_estimate is the project's routing estimator (count_tokens_approximately)"
)


class TraceError(ValueError):
    """A trace file is missing or malformed."""


# -- traces -----------------------------------------------------------------


@dataclass(frozen=True)
class Trajectory:
    """One trace record: one conversation, replayed as one thread."""

    file: str
    line: int
    trace_id: str
    messages: tuple[dict[str, Any], ...]

    @property
    def thread_id(self) -> str:
        """Unique per record (trace ids repeat across records in the SWE-agent file)."""
        return f"{self.file}:{self.line}:{self.trace_id}"

    @property
    def is_swe(self) -> bool:
        """Whether it comes from a SWE-agent trace file (where the targets are judged)."""
        return is_swe_file(self.file)


def is_swe_file(name: str) -> bool:
    """SWE-agent trace files are the ones named ``swe*``."""
    return name.lower().startswith("swe")


def parse_trace_lines(lines: Iterable[str], *, file: str) -> list[Trajectory]:
    """Parse JSONL trace records ``{"id", "messages": [OpenAI chat messages], ...}``.

    Blank lines are skipped.

    Raises:
        TraceError: A line is not JSON, or lacks a ``messages`` list of role-tagged dicts.
    """
    trajectories = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise TraceError(f"{file}:{number}: not JSON ({error})") from error
        messages = record.get("messages") if isinstance(record, dict) else None
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages
        ):
            raise TraceError(f"{file}:{number}: expected a 'messages' list of {{'role': ...}} objects")
        trace_id = str(record.get("id") or f"line{number}")
        trajectories.append(Trajectory(file, number, trace_id, tuple(messages)))
    return trajectories


def trace_files(paths: Sequence[Path]) -> list[Path]:
    """Expand directories to their ``*.jsonl`` files (sorted); files are taken as given.

    Raises:
        TraceError: A path does not exist, or no trace file was found.
    """
    found: list[Path] = []
    for path in paths:
        if path.is_dir():
            found.extend(sorted(path.glob("*.jsonl")))
        elif path.is_file():
            found.append(path)
        else:
            raise TraceError(f"trace path not found: {path}")
    if not found:
        raise TraceError(f"no *.jsonl trace files in {', '.join(map(str, paths))}")
    return found


def load_traces(paths: Sequence[Path]) -> list[Trajectory]:
    """Every trajectory of every trace file under ``paths``."""
    trajectories = []
    for path in trace_files(paths):
        with path.open(encoding="utf-8") as handle:
            trajectories.extend(parse_trace_lines(handle, file=path.stem))
    return trajectories


def select_quick(trajectories: Sequence[Trajectory]) -> list[Trajectory]:
    """The ``--quick`` subset: the first ``QUICK_SWE``/``QUICK_OTHER`` trajectories of each file."""
    taken: dict[str, int] = {}
    chosen = []
    for trajectory in trajectories:
        limit = QUICK_SWE if trajectory.is_swe else QUICK_OTHER
        if taken.get(trajectory.file, 0) < limit:
            taken[trajectory.file] = taken.get(trajectory.file, 0) + 1
            chosen.append(trajectory)
    return chosen


def assistant_positions(messages: Sequence[Mapping[str, Any]]) -> list[int]:
    """Indices of the assistant messages: one agent step each."""
    return [i for i, message in enumerate(messages) if message.get("role") == "assistant"]


# -- routing (the project's own core, driven like the graph drives it) -------


@dataclass(frozen=True)
class RoutedStep:
    """The route of one assistant step of a trajectory."""

    position: int
    step: int
    leg: Leg
    score: int | None
    estimate_tokens: int


def route_trajectory(
    messages: Sequence[Mapping[str, Any]],
    *,
    hysteresis: int,
    cloud_share: int = CLOUD_SHARE,
) -> list[RoutedStep]:
    """Route every assistant step of a trajectory with the graph's own replay (``route_history``)."""
    context = FusionContext(mode="fusion", cloud_share=cloud_share, hysteresis=hysteresis)
    replayed = route_history(convert_to_messages([dict(m) for m in messages]), context)
    return [
        RoutedStep(
            r.position,
            r.step,
            r.leg,
            r.decision.score.score if r.decision.score is not None else None,
            r.signals.prompt_tokens,
        )
        for r in replayed
    ]


# -- the physical minimum ---------------------------------------------------


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def new_token_counts(requests: Iterable[Sequence[int]]) -> list[int]:
    """Tokens of each request that are new since the previous one (the first: all of them).

    Give it one thread's local requests in order; the result is the least any
    prefix cache could process for each.
    """
    counts = []
    previous: Sequence[int] = ()
    for tokens in requests:
        counts.append(len(tokens) - common_prefix_len(previous, tokens))
        previous = tokens
    return counts


@dataclass(frozen=True)
class PlannedStep:
    """A routed step with its token counts."""

    position: int
    step: int
    leg: Leg
    n_tokens: int
    minimum: int
    estimate_tokens: int


@dataclass(frozen=True)
class ThreadPlan:
    """What one thread sends, step by step."""

    trajectory: Trajectory
    steps: tuple[PlannedStep, ...]


def plan_thread(
    trajectory: Trajectory, routed: Sequence[RoutedStep], tokens: Sequence[Sequence[int]]
) -> ThreadPlan:
    """Attach token counts and minima (local steps only; cloud steps get 0) to routed steps.

    ``tokens[i]`` is the rendered prompt of ``routed[i]``.
    """
    local = [i for i, r in enumerate(routed) if r.leg == "local"]
    minima = dict(zip(local, new_token_counts(tokens[i] for i in local), strict=True))
    steps = tuple(
        PlannedStep(r.position, r.step, r.leg, len(tokens[i]), minima.get(i, 0), r.estimate_tokens)
        for i, r in enumerate(routed)
    )
    return ThreadPlan(trajectory, steps)


# -- results ----------------------------------------------------------------


@dataclass(frozen=True)
class StepRecord:
    """What one step cost: server timings for local steps, token counts for cloud ones."""

    file: str
    leg: Leg
    n_tokens: int
    minimum: int
    estimate_tokens: int
    prompt_n: int = 0
    cache_n: int = 0
    prompt_ms: float = 0.0


def summarize(records: Iterable[StepRecord]) -> dict[str, Any]:
    """The per-variant leaf: token totals, efficiency and step counts.

    ``efficiency`` is ``minimum / processed`` (1.0 is perfect; None when
    nothing was processed). ``excess_*`` counts local requests that processed
    more than their minimum, ``token_mismatches`` those whose
    ``prompt_n + cache_n`` differs from our tokenization of the prompt.
    """
    leaf: dict[str, Any] = {
        "processed_tokens": 0,
        "cached_tokens": 0,
        "minimum_tokens": 0,
        "efficiency": None,
        "prefill_ms": 0.0,
        "local_steps": 0,
        "cloud_steps": 0,
        "local_prompt_tokens": 0,
        "cloud_prompt_tokens": 0,
        "cloud_prompt_tokens_estimate": 0,
        "excess_tokens": 0,
        "excess_requests": 0,
        "below_minimum_requests": 0,
        "token_mismatches": 0,
    }
    for r in records:
        if r.leg == "cloud":
            leaf["cloud_steps"] += 1
            leaf["cloud_prompt_tokens"] += r.n_tokens
            leaf["cloud_prompt_tokens_estimate"] += r.estimate_tokens
            continue
        leaf["local_steps"] += 1
        leaf["local_prompt_tokens"] += r.n_tokens
        leaf["processed_tokens"] += r.prompt_n
        leaf["cached_tokens"] += r.cache_n
        leaf["minimum_tokens"] += r.minimum
        leaf["prefill_ms"] += r.prompt_ms
        if r.prompt_n > r.minimum:
            leaf["excess_tokens"] += r.prompt_n - r.minimum
            leaf["excess_requests"] += 1
        elif r.prompt_n < r.minimum:
            leaf["below_minimum_requests"] += 1
        if r.prompt_n + r.cache_n != r.n_tokens:
            leaf["token_mismatches"] += 1
    leaf["prefill_ms"] = round(leaf["prefill_ms"], 1)
    if leaf["processed_tokens"]:
        leaf["efficiency"] = round(leaf["minimum_tokens"] / leaf["processed_tokens"], 4)
    return leaf


def summarize_with_files(records: Sequence[StepRecord]) -> dict[str, Any]:
    """``summarize`` over everything, plus ``files``: the same per trace file."""
    leaf = summarize(records)
    files = sorted({r.file for r in records})
    leaf["files"] = {name: summarize(r for r in records if r.file == name) for name in files}
    return leaf


@dataclass(frozen=True)
class TargetResult:
    """One target at one concurrency level."""

    name: str
    threads: str
    holds: bool | None
    detail: str


def _swe_totals(leaf: Mapping[str, Any]) -> dict[str, Any] | None:
    """Sum of the SWE-agent files' leaves (None when no SWE file was replayed)."""
    parts = [v for k, v in leaf.get("files", {}).items() if is_swe_file(k)]
    if not parts:
        return None
    return {key: sum(p[key] for p in parts) for key in ("processed_tokens", "minimum_tokens")}


def evaluate_targets(variants: Mapping[str, Mapping[str, Any]]) -> list[TargetResult]:
    """Check the two targets on the SWE-agent traces at every concurrency level replayed.

    (a) ``fusion`` processes at most ``TARGET_FUSION_OVER_MINIMUM`` × the minimum;
    (b) ``hazard`` processes at least ``TARGET_HAZARD_OVER_FUSION`` × what ``fusion`` does.
    """
    results = []
    fusion = variants.get("fusion", {}).get("threads", {})
    hazard = variants.get("hazard", {}).get("threads", {})
    for threads, leaf in fusion.items():
        swe = _swe_totals(leaf)
        if swe is None:
            results.append(TargetResult("a", threads, None, "no SWE-agent traces replayed"))
            continue
        processed, minimum = swe["processed_tokens"], swe["minimum_tokens"]
        ratio = processed / minimum if minimum else float("inf")
        results.append(
            TargetResult(
                "a",
                threads,
                ratio <= TARGET_FUSION_OVER_MINIMUM,
                f"fusion processed {processed} = {ratio:.3f} × minimum {minimum} "
                f"(target <= {TARGET_FUSION_OVER_MINIMUM:.2f})",
            )
        )
        hazard_swe = _swe_totals(hazard[threads]) if threads in hazard else None
        if hazard_swe is None:
            results.append(TargetResult("b", threads, None, "hazard variant not replayed"))
            continue
        hazard_ratio = hazard_swe["processed_tokens"] / processed if processed else float("inf")
        results.append(
            TargetResult(
                "b",
                threads,
                hazard_ratio >= TARGET_HAZARD_OVER_FUSION,
                f"hazard processed {hazard_swe['processed_tokens']} = {hazard_ratio:.2f} × fusion "
                f"(target >= {TARGET_HAZARD_OVER_FUSION:.0f})",
            )
        )
    return results


# -- variants and the replay ------------------------------------------------


@dataclass(frozen=True)
class Variant:
    """How local requests are sent, and the hysteresis that routes them."""

    name: str
    hysteresis: int
    pinned: bool
    cache_prompt: bool
    description: str

    def body(self, pool: SlotPool | None, thread_id: str) -> dict[str, Any]:
        """Extra request-body fields of a local step of ``thread_id``."""
        if self.pinned:
            assert pool is not None
            fields = slot_body("local", pool.slot_for(thread_id))
            assert fields is not None
            return {**fields, "cache_prompt": self.cache_prompt}
        return {"cache_prompt": self.cache_prompt}


VARIANTS: tuple[Variant, ...] = (
    Variant(
        "fusion",
        DEFAULTS["hysteresis"],
        True,
        True,
        "id_slot from SlotPool(4) + cache_prompt, default hysteresis",
    ),
    Variant("hazard", DEFAULTS["hysteresis"], False, False, "no id_slot, cache_prompt false"),
    Variant("no_hysteresis", 0, True, True, "id_slot + cache_prompt, hysteresis 0"),
    Variant(
        "server_pick",
        DEFAULTS["hysteresis"],
        False,
        True,
        "no id_slot, cache_prompt true: llama-server picks the slot (by prompt similarity)",
    ),
)
#: Replayed unless ``--variants`` says otherwise (``server_pick`` is an opt-in diagnostic).
DEFAULT_VARIANTS = ("fusion", "hazard", "no_hysteresis")


@dataclass
class Replay:
    """State shared by the workers of one variant run."""

    client: httpx.AsyncClient
    variant: Variant
    pool: SlotPool | None
    records: list[StepRecord] = field(default_factory=list)


async def replay_thread(replay: Replay, plan: ThreadPlan, *, release: bool) -> None:
    """Send one thread's steps in order; local ones to llama-server, cloud ones to the counter."""
    trajectory = plan.trajectory
    for step in plan.steps:
        base = StepRecord(trajectory.file, step.leg, step.n_tokens, step.minimum, step.estimate_tokens)
        if step.leg == "cloud":
            replay.records.append(base)
            continue
        body = {
            "messages": list(trajectory.messages[: step.position]),
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            **replay.variant.body(replay.pool, trajectory.thread_id),
        }
        response = await replay.client.post("/v1/chat/completions", json=body)
        if response.status_code != 200:
            raise RuntimeError(
                f"{trajectory.thread_id} step {step.position}: HTTP {response.status_code}: "
                f"{response.text[:500]}"
            )
        timings = response.json()["timings"]
        replay.records.append(
            StepRecord(
                trajectory.file,
                "local",
                step.n_tokens,
                step.minimum,
                step.estimate_tokens,
                prompt_n=int(timings["prompt_n"]),
                cache_n=int(timings["cache_n"]),
                prompt_ms=float(timings["prompt_ms"]),
            )
        )
    if release and replay.pool is not None:
        replay.pool.release(trajectory.thread_id)


async def run_variant(
    base_url: str, variant: Variant, plans: Sequence[ThreadPlan], concurrency: int, *, release: bool
) -> list[StepRecord]:
    """Replay every thread, ``concurrency`` threads at a time, each thread's steps in order."""
    pool = SlotPool(N_SLOTS, reserve_reflection=False) if variant.pinned else None
    queue = deque(plans)
    limits = httpx.Limits(max_connections=concurrency + 2)
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(600.0), limits=limits) as client:
        replay = Replay(client, variant, pool)

        async def worker() -> None:
            while queue:
                await replay_thread(replay, queue.popleft(), release=release)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return replay.records


async def tokenize_requests(
    base_url: str, requests: Sequence[Sequence[Mapping[str, Any]]]
) -> list[array[int]]:
    """Render each request with the server's chat template, then tokenize it as the server does."""
    results: list[array[int]] = [array("i") for _ in requests]
    semaphore = asyncio.Semaphore(4)
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(120.0)) as client:

        async def one(index: int) -> None:
            async with semaphore:
                rendered = await client.post("/apply-template", json={"messages": list(requests[index])})
                rendered.raise_for_status()
                tokenized = await client.post(
                    "/tokenize",
                    json={"content": rendered.json()["prompt"], "add_special": True, "parse_special": True},
                )
                tokenized.raise_for_status()
                results[index] = array("i", tokenized.json()["tokens"])

        await asyncio.gather(*(one(i) for i in range(len(requests))))
    return results


# -- the server -------------------------------------------------------------


@dataclass(frozen=True)
class ServerSetup:
    """Everything needed to start an identical server for each run."""

    model: Path
    template: Path
    logs: Path

    def server(self, *, n_slots: int, ctx_size: int, name: str) -> LlamaServer:
        """A configured (not yet started) server; the log lands in ``logs/name.log``."""
        from fusion_graph.testing import LlamaServer

        return LlamaServer(
            self.model,
            n_slots=n_slots,
            ctx_size=ctx_size,
            jinja=True,
            extra_args=["--chat-template-file", str(self.template)],
            log_path=self.logs / f"{name}.log",
        )


def prepare_server(workdir: Path) -> ServerSetup:
    """Write the tiny qwen2 model and the tool-capable template into ``workdir``."""
    from fusion_graph.testing import chat_template, ensure_llama_server, vocab_path, write_tiny_model

    ensure_llama_server()
    model = write_tiny_model(workdir / "tiny-qwen2.gguf", vocab_gguf=vocab_path("qwen2"), n_ctx=MODEL_N_CTX)
    template = workdir / f"{TEMPLATE}.jinja"
    template.write_text(chat_template(TEMPLATE), encoding="utf-8")
    logs = workdir / "logs"
    logs.mkdir()
    return ServerSetup(model, template, logs)


def per_slot_ctx(longest_prompt: int) -> int:
    """Per-slot context for the longest prompt plus margin, rounded up to 256 (llama.cpp pads to it)."""
    need = longest_prompt + MAX_TOKENS + CTX_MARGIN
    return -(-need // 256) * 256


def server_version(binary: Path) -> str:
    """First line of ``llama-server --version`` that names the version."""
    result = subprocess.run(
        [str(binary), "--version"], capture_output=True, text=True, timeout=30, check=False
    )
    lines = [line for line in (result.stdout + result.stderr).splitlines() if "version" in line]
    return lines[0].strip() if lines else "unknown"


# -- report -----------------------------------------------------------------


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}" if value < 10 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


COLUMNS: tuple[tuple[str, str], ...] = (
    ("local", "local_steps"),
    ("cloud", "cloud_steps"),
    ("processed", "processed_tokens"),
    ("cached", "cached_tokens"),
    ("minimum", "minimum_tokens"),
    ("eff", "efficiency"),
    ("prefill ms", "prefill_ms"),
    ("wall s", "wall_s"),
)


def format_table(variants: Mapping[str, Mapping[str, Any]]) -> str:
    """Plain-text table: per variant and concurrency, all traces then each trace file."""
    header = ["variant", "thr", "traces", *(name for name, _ in COLUMNS)]
    rows: list[list[str]] = []
    for name, variant in variants.items():
        for threads, leaf in variant["threads"].items():
            rows.append([name, threads, "all", *(_fmt(leaf.get(key)) for _, key in COLUMNS)])
            for file, sub in leaf.get("files", {}).items():
                rows.append(["", "", file, *(_fmt(sub.get(key)) for _, key in COLUMNS)])
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    left = 3

    def line(cells: Sequence[str]) -> str:
        pairs = enumerate(zip(cells, widths, strict=True))
        return "  ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in pairs)

    return "\n".join([line(header), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def format_targets(targets: Sequence[TargetResult]) -> str:
    """One line per target and concurrency level."""
    words = {True: "HOLDS", False: "FAILS", None: "n/a"}
    labels = {
        "a": f"(a) fusion <= {TARGET_FUSION_OVER_MINIMUM:.2f} × minimum",
        "b": f"(b) hazard >= {TARGET_HAZARD_OVER_FUSION:.0f} × fusion",
    }
    return "\n".join(
        f"  {labels[t.name]:<28} threads={t.threads}: {words[t.holds]:<5}  {t.detail}" for t in targets
    )


# -- main -------------------------------------------------------------------


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
        prog="python -m bench.kv_reuse",
        description="KV-cache reuse of fusion routing on a real llama-server, replayed from agent traces.",
    )
    parser.add_argument(
        "--traces",
        nargs="+",
        type=Path,
        default=[DEFAULT_TRACES],
        metavar="PATH",
        help=f"trace files or directories of *.jsonl (default: {DEFAULT_TRACES})",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"replay a subset: {QUICK_SWE} trajectories per SWE-agent file, {QUICK_OTHER} per other file",
    )
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument(
        "--threads",
        type=parse_threads,
        default=[1, 4],
        help="concurrency levels, comma-separated (default: 1,4)",
    )
    parser.add_argument(
        "--variants",
        default=",".join(DEFAULT_VARIANTS),
        help="comma-separated, any of: "
        + ", ".join(v.name for v in VARIANTS)
        + f" (default: {','.join(DEFAULT_VARIANTS)})",
    )
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
    return parser.parse_args(argv)


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


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
    _progress(f"{len(trajectories)} trajectories, {len(requests)} steps")

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
        _progress(f"tokenized in {time.perf_counter() - started:.1f} s; longest prompt {longest} tokens")

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
                _progress(
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
    try:
        result = run(args)
    except TraceError as error:
        missing = not any(p.exists() for p in args.traces)
        hint = (
            " (pass --traces PATH; the default is ../shared/data/traces beside the repo)" if missing else ""
        )
        print(f"error: {error}{hint}", file=sys.stderr)
        return 2
    except ImportError as error:
        print(f"error: {error}; install the dev extras (gguf, numpy) to generate the model", file=sys.stderr)
        return 2
    except RuntimeError as error:  # LlamaServerUnavailable, LlamaServerError, a failed request
        print(f"error: {error}", file=sys.stderr)
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
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
        print(f"JSON written to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
