"""The ``doctor`` command: run every check in order, hide the key, print the table or ``--json``.

The table has three columns, so it reads at 80: the check, its status, and
what was found with the line that fixes it beneath. Exit code 0 when no row
is ``fail`` (``warn`` and ``info`` allowed), else 1.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table
from rich.text import Text

from fusion_graph.cli.checks import first_prompt_tokens, key_variable, unknown_line, unknown_variables
from fusion_graph.cli.common import build_context, build_settings, fail, stdout_console
from fusion_graph.cli.doctor.checkpoints import postgres_check, shared_state_check, sqlite_check
from fusion_graph.cli.doctor.cloud import (
    FoundKey,
    blank_key_check,
    cloud_checks,
    cloud_key_check,
    cloud_price_check,
    find_cloud_key,
    read_dotenv,
)
from fusion_graph.cli.doctor.gateway import pool_checks
from fusion_graph.cli.doctor.llama import llama_checks
from fusion_graph.cli.doctor.rows import Check, count
from fusion_graph.cli.doctor.workspace import workspace_checks
from fusion_graph.cli.stores import DEFAULT_DB
from fusion_graph.redact import REDACTED

if TYPE_CHECKING:
    from fusion_graph.settings import FusionSettings

_STYLES: dict[str, str] = {"ok": "green", "warn": "yellow", "fail": "bold red", "info": "cyan"}


def _hide(
    checks: Sequence[Check], key: FoundKey | None, settings: FusionSettings | None = None
) -> list[Check]:
    """Every row with the key's value replaced, wherever an error message may have echoed it.

    A key put in ``FUSION_CLOUD_API_KEY_ENV`` (``checks.key_variable``) is hidden the same way.
    """
    values = [key.value] if key is not None and key.value else []
    if settings is not None and key_variable(settings) is None:
        values.append(settings.cloud_api_key_env)
    if not values:
        return list(checks)

    def hidden(text: str) -> str:
        for value in sorted(values, key=len, reverse=True):
            text = text.replace(value, REDACTED)
        return text

    return [Check(c.name, c.status, hidden(c.detail), hidden(c.fix)) for c in checks]


def variables_check(unknown: Sequence[tuple[str, str | None]]) -> Check:
    """Every ``FUSION_*`` variable set is one a setting reads; a misspelt one is named with the likely fix."""
    if not unknown:
        return Check("FUSION_* names", "ok", "every FUSION_* variable set is a setting")
    fixes = [f"rename {name} to {meant}" if meant else f"remove {name}" for name, meant in unknown]
    return Check(
        "FUSION_* names", "warn", "; ".join(unknown_line(n, m) for n, m in unknown), "; ".join(fixes)
    )


def render(checks: Sequence[Check]) -> Table:
    """The report as a table: check, status, and what was found with its fix beneath."""
    table = Table(title="fusion-graph doctor", title_justify="left")
    table.add_column("check", no_wrap=True)
    table.add_column("status", no_wrap=True)
    table.add_column("found, and the fix", overflow="fold")
    for check in checks:
        cell = Text(check.detail)
        if check.fix:
            cell.append("\nfix: ", style="bold")
            cell.append(check.fix)
        table.add_row(check.name, Text(check.status, style=_STYLES[check.status]), cell)
    return table


def summary(checks: Sequence[Check]) -> str:
    """One line: how many rows failed and warned."""
    fails = sum(c.status == "fail" for c in checks)
    warns = sum(c.status == "warn" for c in checks)
    verdict = "not ready" if fails else "ready"
    return f"{verdict}: {fails} failed, {count(warns, 'warning')}, {count(len(checks), 'check')}"


def doctor(
    db: Annotated[Path, typer.Option(help="SQLite checkpoint file `fusion-graph run` uses.")] = DEFAULT_DB,
    postgres: Annotated[
        str | None, typer.Option(help="Postgres URL to check instead of the SQLite file.")
    ] = None,
    workspace: Annotated[
        Path | None,
        typer.Option(help="Workspace to check; default FUSION_WORKSPACE_ROOT (or '.')."),
    ] = None,
    context: Annotated[
        str | None,
        typer.Option(
            help="Run context JSON (or file); its max_completion_tokens and cloud_model are checked."
        ),
    ] = None,
    live: Annotated[
        bool,
        typer.Option(
            "--live",
            help="Also send the cloud model a one-token chat completion, and llama-server a short one "
            "to measure its tokens/s.",
        ),
    ] = False,
    timeout: Annotated[float, typer.Option(help="Seconds each network check may take.", min=0.1)] = 5.0,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print one JSON object instead of the table.")
    ] = False,
) -> None:
    """Check the set-up: cloud key, endpoint and price, llama-server, workspace, checkpoint and shared state.

    One row per check with what was found and the line that fixes it. The key
    is only ever named by its variable. llama-server's GET /props gives slots,
    the per-slot window (checked against 2 x max_completion_tokens and the
    graph's first prompt) and the chat template's tool support; a POST
    /apply-template with one tool shows whether --jinja is on and whether the
    tool reaches the prompt. With --live, a short completion measures llama-server's tokens/s and
    warns when max_completion_tokens at that speed would not fit FUSION_REQUEST_TIMEOUT. Exit code 0
    when no check fails (warnings allowed), else 1.
    """
    from fusion_graph.errors import ContextError

    run_context = build_context(context)
    settings = build_settings(workspace_root=str(workspace) if workspace is not None else None)
    try:
        settings = settings.narrow(cloud_model=run_context.cloud_model)
    except ContextError as error:
        raise fail(str(error)) from error
    if workspace is not None:
        source = "--workspace"
    elif os.environ.get("FUSION_WORKSPACE_ROOT"):
        source = "FUSION_WORKSPACE_ROOT"
    else:
        source = "default" if settings.workspace_root == "." else "FUSION_WORKSPACE_ROOT in .env"
    dotenv = read_dotenv()
    key = find_cloud_key(settings, os.environ, dotenv)
    budget, prompt = run_context.max_completion_tokens, first_prompt_tokens(run_context, settings)
    local = pool_checks if settings.local_workers else llama_checks
    blank = blank_key_check(settings, dotenv)
    checks = [
        cloud_key_check(settings, key, local_only=run_context.mode == "local"),
        *([blank] if blank is not None else []),
        *cloud_checks(settings, key, live=live, timeout=timeout),
        cloud_price_check(run_context, settings),
        *local(settings, budget, timeout=timeout, prompt_tokens=prompt, live=live),
        *workspace_checks(settings, source),
        postgres_check(postgres, timeout=timeout) if postgres else sqlite_check(db),
    ]
    if settings.shared_state != "off":
        checks.append(shared_state_check(settings.shared_url(), timeout=timeout))
    checks.append(variables_check(unknown_variables(os.environ, dotenv)))
    checks = _hide(checks, key, settings)
    ok = not any(c.status == "fail" for c in checks)
    if as_json:
        typer.echo(json.dumps({"ok": ok, "checks": [asdict(c) for c in checks]}, indent=2))
    else:
        console = stdout_console()
        console.print(render(checks))
        console.print(summary(checks), highlight=False)
    if not ok:
        raise typer.Exit(1)
