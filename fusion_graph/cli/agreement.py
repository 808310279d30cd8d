"""How often the cloud leg, asked beside a local step (a shadow check), took the same action, by score band.

The operator sees on real traffic whether the steps kept local are the ones
the local model gets right: agreement that falls in the higher score bands is
what a higher ``cloud_share`` would buy. Each share comes with its 95 % Wilson
interval; that the local steps are not worse than cloud is said only against a
margin the operator gives, and only once enough checks back it (else how many
more would, at the agreement seen so far).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from fusion_graph.routing.records import upgraded
from fusion_graph.routing.score import score_band

if TYPE_CHECKING:
    from rich.table import Table

    from fusion_graph.routing.records import RouteRecord


#: z of a two-sided 95 % interval (one-sided 97.5 % lower bound).
Z95 = 1.959963984540054


def wilson(agree: int, checked: int, z: float = Z95) -> tuple[float, float] | None:
    """The Wilson score interval of ``agree`` of ``checked`` (``None`` without checks)."""
    if checked <= 0:
        return None
    p = agree / checked
    centre = p + z * z / (2 * checked)
    spread = z * math.sqrt(p * (1 - p) / checked + z * z / (4 * checked * checked))
    scale = 1 + z * z / checked
    return max(0.0, (centre - spread) / scale), min(1.0, (centre + spread) / scale)


def checks_needed(fraction: float, floor: float, z: float = Z95, limit: int = 10_000_000) -> int | None:
    """The fewest checks whose interval's lower bound clears ``floor`` at agreement ``fraction``.

    ``None`` when no number of checks would (``fraction`` at or under ``floor``).
    """
    if fraction <= floor:
        return None
    low, high = 1, 1
    while (wilson(round(fraction * high), high, z) or (0.0, 0.0))[0] < floor:
        low, high = high, high * 2
        if high > limit:
            return None
    while low < high:  # the lower bound grows with the checks at a fixed fraction
        middle = (low + high) // 2
        if (wilson(round(fraction * middle), middle, z) or (0.0, 0.0))[0] >= floor:
            high = middle
        else:
            low = middle + 1
    return high


def non_inferiority(agree: int, checked: int, margin: float | None) -> dict[str, Any]:
    """Whether the checks show the local steps take the cloud's action at least ``1 - margin`` of the time.

    Shown when the interval's lower bound clears ``1 - margin``; without a margin nothing is claimed.
    """
    if margin is None:
        return {"margin": None, "holds": None, "statement": "give --margin to test it against cloud"}
    floor = 1 - margin
    interval = wilson(agree, checked)
    lower = interval[0] if interval is not None else None
    holds = lower is not None and lower >= floor
    fraction = agree / checked if checked else None
    needed = None
    if holds:
        statement = (
            f"local steps take the cloud's action at least {floor:.0%} of the time "
            f"(95% lower bound {lower:.1%} over {checked} checks)"
        )
    elif fraction is None:
        statement = "no shadow checks yet: set shadow_share to make them"
    elif fraction <= floor:
        statement = f"not shown: agreement {fraction:.1%} is at or under {floor:.0%}"
    else:
        total = checks_needed(fraction, floor)
        needed = None if total is None else max(total - checked, 1)
        statement = (
            f"not shown yet: about {needed} more checks at the agreement seen ({fraction:.1%}) "
            f"would show at least {floor:.0%} (95% lower bound now {lower:.1%})"
        )
    return {
        "margin": margin,
        "floor": floor,
        "lower_bound": lower,
        "holds": holds,
        "checks_needed": needed,
        "statement": statement,
    }


def agreement(records: Iterable[RouteRecord], margin: float | None = None) -> dict[str, Any]:
    """The shadow checks among ``records``: checked, agreeing and their cost, in all and by score band."""
    bands: dict[str, dict[str, Any]] = {}
    checked = agreed = 0
    cost = 0.0
    for record in records:
        shadow = upgraded(record).get("shadow") if record["kind"] == "shadow" else None
        if not shadow or shadow.get("agrees") is None:
            continue
        row = bands.setdefault(score_band(shadow.get("score")), {"checked": 0, "agree": 0})
        row["checked"] += 1
        row["agree"] += bool(shadow["agrees"])
        checked, agreed = checked + 1, agreed + bool(shadow["agrees"])
        cost += shadow.get("cost_usd") or 0.0
    for row in bands.values():
        row["agree_fraction"] = round(row["agree"] / row["checked"], 4)
        row["ci95"] = [round(x, 4) for x in wilson(row["agree"], row["checked"]) or ()]
    ordered = dict(sorted(bands.items(), key=lambda item: (item[0] == "-", item[0].zfill(7))))
    return {
        "checked": checked,
        "agree": agreed,
        "agree_fraction": round(agreed / checked, 4) if checked else None,
        "ci95": [round(x, 4) for x in wilson(agreed, checked) or ()],
        "cost_usd": cost,
        "bands": ordered,
        "non_inferiority": non_inferiority(agreed, checked, margin),
    }


def agreement_table(summary: dict[str, Any]) -> Table:
    """Shadow checks by score band: how many, how many agreed, and the share."""
    from fusion_graph.cli.tables import add_number_columns, compact_table

    table = compact_table(
        "shadow checks: did the cloud take the local step's action?",
        f"{summary['checked']} checks, ${summary['cost_usd']:.6f} on cloud; score bands of the local steps",
    )
    add_number_columns(table, "score", "checked", "agreed", "share", "95% interval")
    for band, row in summary["bands"].items():
        low, high = row["ci95"]
        share = f"{row['agree_fraction']:.0%}"
        table.add_row(band, str(row["checked"]), str(row["agree"]), share, f"{low:.0%}-{high:.0%}")
    table.caption = f"{table.caption}; {summary['non_inferiority']['statement']}"
    return table
