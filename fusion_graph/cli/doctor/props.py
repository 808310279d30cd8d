"""Doctor's llama-server rows from what the server said: ``GET /props`` and the tools probe (pure).

``/props`` gives the slots, the per-slot window (checked against the completion
budget and the graph's first prompt) and the chat template's tool support;
``POST /apply-template`` with one tool (``PROBE_TOOL``) shows whether ``--jinja``
is on and whether the tool reaches the rendered prompt.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from fusion_graph.cli.doctor.rows import Check

if TYPE_CHECKING:
    from fusion_graph.providers.llama_server import ServerProps
    from fusion_graph.settings import FusionSettings

#: The name of the one tool ``POST /apply-template`` is asked to render (nothing is generated).
PROBE_NAME = "doctor_probe"
PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": PROBE_NAME,
        "description": "fusion-graph doctor checks that the server accepts tools.",
        "parameters": {"type": "object", "properties": {}},
    },
}

#: What llama-server's ``GET /props`` does not say (b1-0c1e570, llama-cpp-python 0.3.36), so doctor
#: cannot check it; a later build that reports ``kv_unified`` gets that one checked.
NOT_IN_PROPS = (
    "--kv-unified",
    "whether -np was explicit (auto -np turns --kv-unified on)",
    "--cache-ram",
    "--slot-prompt-similarity",
    "--cache-reuse",
)

#: Said wherever the probe tool is missing from the rendered prompt.
TOOLS_DROPPED = (
    "POST /apply-template with one tool rendered a prompt without it: the model on this server never "
    "sees the tools, so local steps cannot call them"
)


def slots_check(props: ServerProps, settings: FusionSettings) -> Check:
    """``total_slots`` against ``FUSION_LOCAL_SLOTS`` and the reflection slot memory jobs use."""
    total, configured = props.total_slots, settings.local_slots
    if configured > total:
        return Check(
            "slots",
            "fail",
            f"FUSION_LOCAL_SLOTS={configured} but the server runs {total} (total_slots): requests pinned "
            f"to slots {total}..{configured - 1} are refused",
            f"start llama-server with -np {configured}, or set FUSION_LOCAL_SLOTS=0 (ask the server)",
        )
    if configured and configured < total:
        return Check(
            "slots",
            "warn",
            f"FUSION_LOCAL_SLOTS={configured} but the server runs {total}: "
            f"{total - configured} slot(s) unused",
            "set FUSION_LOCAL_SLOTS=0 to use what the server reports",
        )
    if total == 1:
        return Check(
            "slots",
            "warn",
            "1 slot (total_slots): memory jobs have no reflection slot of their own and evict the "
            "conversation's cached prefix",
            "start llama-server with an explicit -np of 2 or more (e.g. -np 4)",
        )
    if settings.reserve_reflection_slot:
        detail = f"{total} slots: {total - 1} for conversations, slot {total - 1} kept for memory jobs"
    else:
        detail = (
            f"{total} slots, shared by conversations and memory jobs (FUSION_RESERVE_REFLECTION_SLOT off)"
        )
    return Check("slots", "ok", detail)


def window_check(
    props: ServerProps, settings: FusionSettings, budget: int, *, prompt_tokens: int = 0
) -> Check:
    """The per-slot window (``n_ctx`` per slot) holds 2 x the budget, and the first prompt beside it.

    Args:
        props: What ``/props`` said.
        settings: The operator's settings (``FUSION_LOCAL_WINDOW_TOKENS``).
        budget: The run's ``max_completion_tokens``.
        prompt_tokens: The graph's first prompt (``checks.first_prompt_tokens``); 0: not checked.
    """
    from fusion_graph.providers.llama_server import slot_window_for, start_command
    from fusion_graph.routing.rule import completion_budget

    name, window, configured = "slot window", props.slot_window, settings.local_window_tokens
    lower = "or lower max_completion_tokens (FUSION_MAX_COMPLETION_TOKENS, or the run's context)"
    if window is None and not configured:
        return Check(
            name,
            "warn",
            "/props does not say how many tokens a slot holds: every step is assumed to fit",
            "set FUSION_LOCAL_WINDOW_TOKENS to the per-slot context (-c / -np)",
        )
    if window is not None and configured > window:
        return Check(
            name,
            "fail",
            f"FUSION_LOCAL_WINDOW_TOKENS={configured} but a slot holds {window} tokens (n_ctx per slot): "
            "prompts sized for the setting overflow the slot",
            "set FUSION_LOCAL_WINDOW_TOKENS=0 (ask the server) or start it with "
            f"-c {configured * props.total_slots}",
        )
    effective = configured or window
    assert effective is not None
    source = "FUSION_LOCAL_WINDOW_TOKENS" if configured else "n_ctx per slot"
    needed = slot_window_for(budget, prompt_tokens)
    start = start_command(
        budget, prompt_tokens=prompt_tokens, slots=props.total_slots, base_url=settings.local_base_url
    )
    fix = f"give each slot at least {needed} tokens: {start} (per slot = -c / -np), {lower}"
    answer = completion_budget(budget, effective)
    if answer < budget:
        return Check(
            name,
            "fail",
            f"{effective} tokens per slot ({source}) < 2 x max_completion_tokens ({budget}): an answer "
            f"gets at most half a slot, so local answers stop at {answer} tokens and a long one (a whole "
            "file to write) is cut off",
            fix,
        )
    room = effective - answer
    if room < prompt_tokens:
        return Check(
            name,
            "fail",
            f"{effective} tokens per slot ({source}) leave {room} for the prompt beside the answer budget "
            f"({answer}), less than the graph's first prompt (about {prompt_tokens} tokens: system prompt "
            "and tool definitions): no local step fits (each goes to cloud, or fails in mode=local)",
            fix,
        )
    prompts = f"; {room} left for prompts (the first is about {prompt_tokens})" if prompt_tokens else ""
    return Check(
        name, "ok", f"{effective} tokens per slot ({source}) >= 2 x max_completion_tokens ({budget}){prompts}"
    )


def jinja_check(code: int | None, message: str) -> Check:
    """Whether llama-server accepts ``tools`` (its Jinja engine is on): ``POST /apply-template`` with one.

    ``/props`` does not say whether ``--jinja`` is on; a server without it answers
    a request with tools "tools param requires --jinja flag".

    Args:
        code: The HTTP status of the probe, ``None`` when it could not be sent.
        message: Its error message, or the transport error (the rendered prompt when it succeeded).
    """
    name = "tool calling"
    if code is not None and code < 300:
        return Check(name, "ok", "--jinja is on: a request with tools is accepted (POST /apply-template)")
    if "jinja" in message.lower():
        return Check(
            name,
            "fail",
            f"llama-server refuses tools: {message!r} (POST /apply-template answered {code}); the agent's "
            "local steps would all fail",
            "restart llama-server with --jinja (and without --no-jinja / LLAMA_ARG_JINJA=false)",
        )
    if code == 404:
        return Check(
            name,
            "info",
            "this llama-server has no POST /apply-template: whether --jinja is on was not checked",
            "make sure llama-server runs with --jinja (tool calling needs it)",
        )
    what = f"answered {code}" if code is not None else "failed"
    return Check(
        name,
        "warn",
        f"POST /apply-template with a tool {what} ({message}): tool calling not confirmed",
        "make sure llama-server runs with --jinja (tool calling needs it)",
    )


def template_check(raw: Mapping[str, Any], rendered: str | None = None) -> Check:
    """Whether tools reach the prompt: ``chat_template_caps.supports_tools``, and what the probe rendered.

    Args:
        raw: ``GET /props`` as JSON.
        rendered: The prompt ``POST /apply-template`` rendered with ``PROBE_TOOL``; ``None`` or
            empty: not observed.
    """
    name = "chat template"
    fix = "serve a model whose template supports tools, or pass --chat-template-file TOOLS.jinja"
    seen = None if not rendered else PROBE_NAME in rendered
    caps = raw.get("chat_template_caps")
    says = caps.get("supports_tools") if isinstance(caps, dict) else None
    if not isinstance(says, bool):
        if seen is False:
            return Check(name, "fail", TOOLS_DROPPED, fix)
        if seen:
            return Check(name, "ok", "POST /apply-template renders the probe tool into the prompt")
        return Check(
            name,
            "info",
            "/props has no chat_template_caps.supports_tools: the template's tool support was not checked",
        )
    if seen is False:
        return Check(
            name, "fail", f"chat_template_caps.supports_tools={str(says).lower()}, but {TOOLS_DROPPED}", fix
        )
    if says:
        parallel = (
            "with" if isinstance(caps, dict) and caps.get("supports_parallel_tool_calls") else "without"
        )
        return Check(
            name,
            "ok",
            f"the chat template renders tools (chat_template_caps.supports_tools), {parallel} parallel calls",
        )
    if seen:
        return Check(
            name,
            "warn",
            "the chat template does not render tools (chat_template_caps.supports_tools=false); POST "
            "/apply-template shows llama.cpp wrote the probe tool into the prompt itself, in its generic "
            "format: tool calls may be less reliable than with a template made for them",
            fix,
        )
    return Check(
        name,
        "warn",
        "the chat template does not render tools (chat_template_caps.supports_tools=false); whether tools "
        "reach the prompt was not observed (POST /apply-template rendered nothing)",
        fix,
    )


def cache_checks(raw: Mapping[str, Any]) -> list[Check]:
    """KV-cache settings: checked when ``/props`` says them, else one ``info`` row naming what it does not."""
    checks: list[Check] = []
    unsaid = list(NOT_IN_PROPS)
    unified = raw.get("kv_unified")
    if isinstance(unified, bool):
        unsaid.remove("--kv-unified")
        checks.append(
            Check(
                "kv cache",
                "warn",
                "--kv-unified is on: slots share one KV buffer, so one conversation's prefix can be "
                "evicted by another's and slot affinity saves less",
                "start llama-server with an explicit -np N and --no-kv-unified",
            )
            if unified
            else Check("kv cache", "ok", "one KV cache per slot (kv_unified false)")
        )
    if raw.get("endpoint_slots") is False:
        checks.append(
            Check(
                "slots endpoint",
                "warn",
                "GET /slots is off (--no-slots): the graph cannot see whether a slot is still busy after a "
                "failed request (it then keeps the slot's turn 2 s blind) nor which slots are empty to warm",
                "start llama-server without --no-slots",
            )
        )
    checks.append(
        Check(
            "not in /props",
            "info",
            "/props does not say " + ", ".join(unsaid) + ": not checked",
            "start it with an explicit -np N (one KV cache per slot; auto -np shares one); for many more "
            "threads than slots, -sps 1 and a --cache-ram that holds the threads' prefixes "
            "(docs/deploying.md); the graph warms empty slots itself",
        )
    )
    return checks


def props_checks(
    props: ServerProps,
    raw: Mapping[str, Any],
    probe: tuple[int | None, str],
    settings: FusionSettings,
    budget: int,
    *,
    prompt_tokens: int = 0,
) -> list[Check]:
    """The rows for a reachable llama-server, from its ``/props`` and the tools probe (pure).

    Args:
        props: What ``fetch_props`` made of ``/props``.
        raw: ``GET /props`` as JSON.
        probe: ``(status, text)`` of ``POST /apply-template`` with ``PROBE_TOOL``: the error
            message, or the rendered prompt when it succeeded.
        settings: The operator's settings.
        budget: The run's ``max_completion_tokens``.
        prompt_tokens: The graph's first prompt; 0: not checked.
    """
    code, text = probe
    rendered = text if code is not None and code < 300 else None
    return [
        slots_check(props, settings),
        window_check(props, settings, budget, prompt_tokens=prompt_tokens),
        jinja_check(code, text),
        template_check(raw, rendered),
        *cache_checks(raw),
    ]
