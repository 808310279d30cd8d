"""``fusion-graph demo``: a recorded conversation played live through the real graph, no key, no server.

A first run should show routing at work on both legs, but a fresh install has
no cloud key, and the small local models one can start without a GPU never
call a tool, so every turn would be one plan record. The demo keeps everything
real but the words: ``build_graph`` routes every step by its score, the tool
calls are dispatched and the records priced as in production, while scripted
models answer each step with the recorded assistant message (the same one
whichever leg the step was routed to) and scripted tools answer each call with
its recorded output (``replay.playback``). With ``--local-url`` the local
leg's prompts really go to llama-server (prefill only), so its prompt and
cached token counts are the server's own.

It shows the table ``run`` shows, every step's reason and score terms below it,
then the cost per provider and leg and the cloud share.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from fusion_graph.cli.common import build_settings, context_dict, fail, load_or_fail, stdout_console

if TYPE_CHECKING:
    from fusion_graph.cli.run import RunResult
    from fusion_graph.context import FusionContext
    from fusion_graph.replay.playback import RecordedScript
    from fusion_graph.replay.traces import RecordedTrajectory
    from fusion_graph.settings import FusionSettings

#: The bundled conversation played by default: a ten-step coding loop whose later steps score high
#: enough (deep in the turn, long tool output) to cross the threshold at ``DEMO_CLOUD_SHARE``.
DEMO_CONVERSATION = "coding-4"
#: The demo's dial: on ``DEMO_CONVERSATION`` the graph routes some continuation steps to each leg.
DEMO_CLOUD_SHARE = 70
#: Run fields the demo turns off whatever ``--context`` says: the recording has no answers for
#: memory jobs, shadow checks or a re-synthesised reply, only for the agent's own steps.
RECORDING_ONLY: dict[str, Any] = {"sub_runners": "off", "shadow_share": 0.0, "resynthesize": "off"}


def pick(
    trajectories: Sequence[RecordedTrajectory], which: str | None, default: str | None
) -> RecordedTrajectory:
    """The conversation to play: ``which`` as an id, else as a 0-based index; none: ``default`` or the first.

    Raises:
        typer.Exit: ``which`` names no conversation (the error lists the ids there are).
    """
    if which is None:
        named = next((t for t in trajectories if t.id == default), None) if default else None
        return named or trajectories[0]
    for trajectory in trajectories:
        if trajectory.id == which:
            return trajectory
    if which.isdigit() and int(which) < len(trajectories):
        return trajectories[int(which)]
    ids = ", ".join(t.id for t in trajectories[:12]) + (", ..." if len(trajectories) > 12 else "")
    raise fail(
        f"--conversation {which!r} is neither an id nor an index (0-{len(trajectories) - 1}) of the "
        f"{len(trajectories)} conversations: {ids}"
    )


def demo_context(script: RecordedScript, raw: str | None, cloud_share: int | None) -> FusionContext:
    """The run context: the demo's dial and the recorded system prompt, under ``--context``, under flags.

    Memory jobs, shadow checks and re-synthesis are off (``RECORDING_ONLY``).
    """
    from fusion_graph.context import ensure_context
    from fusion_graph.errors import ContextError

    data: dict[str, Any] = {"cloud_share": DEMO_CLOUD_SHARE}
    if script.system:
        data["system_prompt"] = script.system
    data |= context_dict(raw)
    if cloud_share is not None:
        data["cloud_share"] = cloud_share
    try:
        return ensure_context(data | RECORDING_ONLY)
    except ContextError as error:
        raise fail(str(error)) from None


async def check_local_url(url: str, context: FusionContext, settings: FusionSettings) -> None:
    """Fail in one line, before anything runs, when no llama-server answers at ``--local-url``.

    Otherwise each local step would fall over to the cloud leg and the demo would
    quietly show no local step at all.
    """
    from fusion_graph.cli.checks import local_start_line, unreachable_reason
    from fusion_graph.errors import LlamaServerUnavailable, NotLlamaServer
    from fusion_graph.providers.llama_server import fetch_total_slots

    try:
        await fetch_total_slots(url, timeout=3.0)
    except LlamaServerUnavailable as error:
        raise fail(
            f"llama-server is not reachable at --local-url {url} ({unreachable_reason(error)}): start it "
            f"({local_start_line(context, settings)}) or leave --local-url out to play without it"
        ) from None
    except NotLlamaServer as error:
        raise fail(f"--local-url {url}: {error}") from None


async def play(
    trajectory: RecordedTrajectory,
    context: FusionContext,
    settings: FusionSettings,
    *,
    local_url: str | None = None,
    on_event: Callable[[Mapping[str, Any]], None] | None = None,
) -> RunResult:
    """Play ``trajectory`` through ``build_graph``, one graph turn per recorded user message.

    Args:
        trajectory: The recorded conversation.
        context: The run context (``demo_context``).
        settings: The operator's settings: the cloud model and prices the steps are priced at.
        local_url: llama-server's ``/v1`` URL: the local leg's prompts are prefilled there;
            ``None``: both legs are scripted.
        on_event: Called with each live-view event (``cli.live.StepTable.apply``).

    Returns:
        The whole conversation as one ``RunResult``: every record of every turn, the
        totals and cloud share over them, the last turn's answer.

    Raises:
        TraceError: The conversation has nothing to play.
    """
    from langchain_core.messages import HumanMessage
    from langgraph.checkpoint.memory import InMemorySaver

    from fusion_graph.agent import build_graph
    from fusion_graph.cli.run import RunResult, stream_events
    from fusion_graph.providers.http import loop_safe_client
    from fusion_graph.providers.models import LOCAL_API_KEY
    from fusion_graph.providers.resolver import ProviderResolver
    from fusion_graph.replay.playback import (
        PrefillLlamaServer,
        RecordedChatModel,
        RecordedScript,
        recorded_tools,
    )

    script = RecordedScript.of(trajectory)
    # Named after the operator's cloud model, so cloud steps are priced at its prices.
    cloud_model = settings.narrow(cloud_model=context.cloud_model).cloud_model
    cloud = RecordedChatModel(script=script, model_name=cloud_model, disable_streaming=True)
    local = (
        PrefillLlamaServer(
            script=script,
            model=settings.local_model,
            base_url=local_url,
            api_key=LOCAL_API_KEY,
            timeout=settings.request_timeout,
            max_retries=0,
            stream_usage=True,
            disable_streaming=True,
            http_async_client=loop_safe_client(settings.request_timeout),
        )
        if local_url
        else RecordedChatModel(script=script, model_name=settings.local_model, disable_streaming=True)
    )
    resolver = ProviderResolver(cloud=cloud, local=local, settings=settings)
    thread = f"demo-{uuid.uuid4().hex[:8]}"
    config: Any = {"configurable": {"thread_id": thread}}
    modes = ["values"] if on_event is None else ["custom", "updates", "values"]
    values: dict[str, Any] = {}
    try:
        graph = build_graph(
            resolver=resolver, tools=recorded_tools(script, trajectory.tools), checkpointer=InMemorySaver()
        )
        for turn in script.turns:
            if not turn.answers:
                continue  # a closing user message nobody answered: nothing recorded to play
            script.start(turn)
            user = HumanMessage(turn.user.content)
            async for mode, chunk in graph.astream(
                {"messages": [user]}, config, context=context, stream_mode=modes
            ):
                if mode == "values" and isinstance(chunk, dict):
                    values = chunk
                elif on_event is not None:
                    for event in stream_events(mode, chunk):
                        on_event(event)
    finally:
        await resolver.aclose()
    return RunResult.of(values, thread, list(values.get("route_log", [])))


def demo(
    trace: Annotated[
        Path | None,
        typer.Option(
            help="A trace file (JSONL, one conversation a line). Default: the bundled sample "
            "(fusion_graph/replay/sample_traces).",
            show_default=False,
        ),
    ] = None,
    conversation: Annotated[
        str | None,
        typer.Option(
            help=f"Which conversation to play: its id, or its 0-based index in the file. Default: "
            f"{DEMO_CONVERSATION} of the sample, else the file's first.",
            show_default=False,
        ),
    ] = None,
    cloud_share: Annotated[
        int | None,
        typer.Option(
            "--cloud-share",
            help=f"The dial, 0-100 (default {DEMO_CLOUD_SHARE}: both legs on the sample's default).",
            min=0,
            max=100,
            show_default=False,
        ),
    ] = None,
    context: Annotated[
        str | None, typer.Option(help="FusionContext fields as a JSON object (or a JSON file).")
    ] = None,
    local_url: Annotated[
        str | None,
        typer.Option(
            "--local-url",
            help="llama-server's /v1 URL: each local step's prompt is prefilled there (max_tokens 1) "
            "so its prompt and cached tokens are real; the recording still answers.",
        ),
    ] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print one JSON object (route_log, totals, cloud_share), no table.")
    ] = False,
) -> None:
    """Play a recorded conversation live through the real graph: no key, no server, no GPU.

    The graph routes every step by its score and runs it on the leg it chose;
    scripted models answer each step with the recorded assistant message and
    scripted tools answer each call with its recorded output. The table shows
    each step's leg, score against the threshold, tokens and cost, and under it
    every step's reason and score terms; then the cost per provider and leg (the
    cloud leg priced as FUSION_CLOUD_MODEL) and the cloud share. Memory jobs,
    shadow checks and re-synthesis are off: the recording has no answers for them.
    """
    from fusion_graph.errors import (
        ChainExhausted,
        ContextError,
        InvalidInput,
        LlamaServerUnavailable,
        ProviderConfigError,
        ProviderRequestError,
        TraceError,
    )
    from fusion_graph.replay.playback import RecordedScript
    from fusion_graph.replay.traces import SAMPLE_TRACES

    trajectories = load_or_fail([trace if trace is not None else SAMPLE_TRACES])
    chosen = pick(trajectories, conversation, None if trace is not None else DEMO_CONVERSATION)
    try:
        script = RecordedScript.of(chosen)
    except TraceError as error:
        raise fail(str(error)) from None
    run_context = demo_context(script, context, cloud_share)
    settings = build_settings(**({"local_base_url": local_url} if local_url else {}))
    try:
        if local_url:
            asyncio.run(check_local_url(local_url, run_context, settings))
        if as_json:
            result = asyncio.run(play(chosen, run_context, settings, local_url=local_url))
        else:
            result = _play_live(chosen, run_context, settings, local_url)
    except (
        ProviderConfigError,
        ContextError,
        LlamaServerUnavailable,
        InvalidInput,
        TraceError,
        ChainExhausted,
        ProviderRequestError,
    ) as error:
        raise fail(str(error)) from None
    if as_json:
        typer.echo(
            json.dumps({"conversation": chosen.id, "file": chosen.file, **asdict(result)}, default=str)
        )


def _play_live(
    trajectory: RecordedTrajectory, context: FusionContext, settings: FusionSettings, local_url: str | None
) -> RunResult:
    """``play`` with the live table of ``run`` (every step's reason and terms), then its summary."""
    from rich.live import Live

    from fusion_graph.cli.live import StepTable, print_result

    console = stdout_console()
    where = f"llama-server at {local_url} prefills the local steps" if local_url else "no model is called"
    console.print(
        f"{trajectory.id} ({trajectory.file}), cloud_share={context.cloud_share}: the graph routes each "
        f"step; the recording answers ({where})",
        highlight=False,
        markup=False,
    )
    steps = StepTable(details=True, terms=True)
    with Live(steps.render(), console=console, refresh_per_second=8):
        result = asyncio.run(play(trajectory, context, settings, local_url=local_url, on_event=steps.apply))
    print_result(console, result)
    return result
