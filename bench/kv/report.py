"""Plain-text report of a run: the results table, the targets and what the numbers mean."""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import Any

from bench.kv.results import TARGET_FUSION_OVER_MINIMUM, TARGET_HAZARD_OVER_FUSION, TargetResult

TIMING_NOTE = (
    "Timing figures (prefill ms, wall s) come from one tiny random-weight model on this machine: "
    "compare them within one run only, never across runs or machines."
)
CLOUD_COUNT_NOTE = (
    "cloud steps are not sent anywhere; their prompt is rendered by llama-server (/apply-template) "
    "and counted with its tokenizer (/tokenize), the same tokens the minimum uses; "
    "cloud_prompt_tokens_estimate is the project's routing estimator (count_tokens_approximately)"
)
#: How a target or check line states its verdict (``None``: it could not be judged).
VERDICT_WORDS: Mapping[bool | None, str] = {True: "HOLDS", False: "FAILS", None: "n/a"}


def progress(message: str) -> None:
    """A progress line on stderr, flushed at once: stdout keeps only the report (all three benchmarks)."""
    print(message, file=sys.stderr, flush=True)


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
    return plain_table(header, rows, left=3)


def plain_table(header: Sequence[str], rows: Sequence[Sequence[str]], *, left: int) -> str:
    """Columns as wide as their widest cell, a dashed rule under the header; the first ``left``
    columns left-aligned, the rest right-aligned (the one-box and the gateway tables alike)."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        pairs = enumerate(zip(cells, widths, strict=True))
        return "  ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in pairs)

    return "\n".join([line(header), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def format_targets(targets: Sequence[TargetResult]) -> str:
    """One line per target and concurrency level."""
    labels = {
        "a": f"(a) fusion <= {TARGET_FUSION_OVER_MINIMUM:.2f} × minimum",
        "b": f"(b) hazard >= {TARGET_HAZARD_OVER_FUSION:.0f} × fusion",
    }
    return "\n".join(
        f"  {labels[t.name]:<28} threads={t.threads}: {VERDICT_WORDS[t.holds]:<5}  {t.detail}"
        for t in targets
    )
