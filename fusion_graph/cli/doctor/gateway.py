"""Doctor's rows for a gateway over several llama-servers (``FUSION_LOCAL_WORKERS``).

Each box is checked as a llama-server of its own; the boxes must agree on
model, slots and window; the gateway must serve ``local_model`` and should
carry a routing header so a thread keeps its box.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from fusion_graph.cli.doctor.llama import server_checks
from fusion_graph.cli.doctor.rows import Check
from fusion_graph.redact import scrub

if TYPE_CHECKING:
    from fusion_graph.settings import FusionSettings


def _v1(url: str) -> str:
    """A box's URL as an OpenAI-style base URL (ends in ``/v1``)."""
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


def pool_checks(
    settings: FusionSettings, budget: int, *, timeout: float, prompt_tokens: int = 0, live: bool = False
) -> list[Check]:
    """A gateway over ``local_workers``: each box as llama-server, their agreement, the gateway itself.

    With ``live``, each box's generation speed too (a box is as slow as its own CPU or GPU).
    """
    import httpx

    rows: list[Check] = []
    seen: list[tuple[str, tuple[Any, ...]]] = []
    for index, url in enumerate(settings.local_workers, start=1):
        box = settings.model_copy(update={"local_base_url": _v1(url), "local_workers": ()})
        checks, props = server_checks(box, budget, timeout=timeout, prompt_tokens=prompt_tokens, live=live)
        rows += [dataclasses.replace(check, name=f"box {index}: {check.name}") for check in checks]
        if props is None:  # unreachable, or not llama-server: its rows say so
            continue
        seen.append((url, (props.model, props.total_slots, props.slot_window)))
    if len({shape for _, shape in seen}) > 1:
        shapes = "; ".join(f"{url}: model {m!r}, {n} slots of {w} tokens" for url, (m, n, w) in seen)
        rows.append(
            Check(
                "boxes agree",
                "fail",
                f"the boxes differ ({shapes}): the first step would stop with LocalPoolMismatch",
                "start every box with the same model, --alias, -np and -c",
            )
        )
    elif len(seen) > 1:
        rows.append(Check("boxes agree", "ok", f"{len(seen)} boxes serve the same model, slots and window"))
    models = settings.local_base_url.rstrip("/") + "/models"
    try:
        with httpx.Client(timeout=timeout) as client:
            answer = client.get(models)
        served = [m.get("id") for m in answer.json().get("data", [])] if answer.status_code == 200 else []
    except (httpx.HTTPError, ValueError, AttributeError) as error:
        return [
            *rows,
            Check(
                "gateway",
                "fail",
                f"not reachable at {settings.local_base_url} ({scrub(repr(error))})",
                "start it: smg launch --worker-urls BOX... --policy manual --routing-key-headers "
                f"{settings.local_routing_header or 'x-fusion-thread'} --assignment-mode min_group",
            ),
        ]
    if settings.local_model not in served:
        return [
            *rows,
            Check(
                "gateway",
                "fail",
                f"GET {models} lists {served}, not local_model {settings.local_model!r}: every local "
                "request would be refused",
                f"start each box with --alias {settings.local_model} (or set FUSION_LOCAL_MODEL)",
            ),
        ]
    header = settings.local_routing_header
    detail = f"{settings.local_base_url} serves {settings.local_model!r}" + (
        f"; local requests carry {header}" if header else "; no routing header: threads may change boxes"
    )
    return [*rows, Check("gateway", "ok" if header else "warn", detail)]
