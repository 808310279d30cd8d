"""The runtime context: defaults, environment fallbacks, validation and the docs table."""

from __future__ import annotations

import dataclasses
import os
import re
import socket
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from fusion_graph import prompts
from fusion_graph.context import DEFAULTS, ENV_PREFIX, FusionContext, context_fields, ensure_context
from fusion_graph.graph import build_graph
from tests.conftest import NetworkBlockedError, is_loopback
from tests.fakes import scripted, user_input

README = Path(__file__).resolve().parent.parent / "README.md"
FIELD_NAMES = [f.name for f in dataclasses.fields(FusionContext)]


def test_defaults() -> None:
    context = FusionContext()
    assert context.mode == "fusion"
    assert context.cloud_share == 30
    assert context.hysteresis == 10
    assert context.max_steps == 25
    assert context.conversation_max_tokens == 32768
    assert context.max_tool_calls_per_step == 8
    assert context.loop_repeat_limit == 3
    assert context.max_repair_attempts == 2
    assert context.cloud_api_key_env == "OPENAI_API_KEY"
    assert context.local_base_url.endswith("/v1")
    assert context.system_prompt == prompts.SYSTEM_PROMPT
    assert context.workspace_root == "."


def test_every_field_defaults_to_its_documented_default() -> None:
    context = FusionContext()
    assert set(DEFAULTS) == set(FIELD_NAMES)
    assert {name: getattr(context, name) for name in FIELD_NAMES} == DEFAULTS


def test_env_names_follow_the_prefix() -> None:
    names = FusionContext().env_names
    assert names["cloud_share"] == "FUSION_CLOUD_SHARE"
    assert set(names) == set(FIELD_NAMES)
    assert all(env == ENV_PREFIX + field.upper() for field, env in names.items())


@pytest.mark.parametrize(
    ("env", "value", "field", "expected"),
    [
        ("FUSION_CLOUD_SHARE", "55", "cloud_share", 55),
        ("FUSION_MODE", "local", "mode", "local"),
        ("FUSION_MAX_STEPS", "7", "max_steps", 7),
        ("FUSION_REQUEST_TIMEOUT", "2.5", "request_timeout", 2.5),
        ("FUSION_WORKSPACE_ROOT", "/srv/ws", "workspace_root", "/srv/ws"),
    ],
)
def test_env_fallbacks_are_converted(
    monkeypatch: pytest.MonkeyPatch, env: str, value: str, field: str, expected: object
) -> None:
    monkeypatch.setenv(env, value)
    actual = getattr(FusionContext(), field)
    assert actual == expected
    assert type(actual) is type(expected)


def test_explicit_values_beat_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FUSION_CLOUD_SHARE", "55")
    assert FusionContext(cloud_share=10).cloud_share == 10
    assert ensure_context({"cloud_share": 20}).cloud_share == 20


@pytest.mark.parametrize(
    ("value", "message"),
    [("abc", "valid integer"), ("150", "must be between 0 and 100"), ("-1", "must be between 0 and 100")],
)
def test_invalid_env_values_are_rejected(monkeypatch: pytest.MonkeyPatch, value: str, message: str) -> None:
    monkeypatch.setenv("FUSION_CLOUD_SHARE", value)
    with pytest.raises(ValidationError) as info:
        FusionContext()
    assert "cloud_share" in str(info.value)
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("cloud_share", 150, "must be between 0 and 100, got 150"),
        ("cloud_share", -1, "must be between 0 and 100, got -1"),
        ("mode", "x", "'cloud', 'local' or 'fusion'"),
        ("max_steps", 0, "must be between 1 and 1000"),
        ("hysteresis", 51, "must be between 0 and 50"),
        ("conversation_max_tokens", 100, "must be at least 256"),
        ("loop_repeat_limit", 1, "must be between 2 and 100"),
        ("max_tool_calls_per_step", 0, "must be between 1 and 128"),
        ("max_repair_attempts", 11, "must be between 0 and 10"),
        ("request_timeout", 0, "must be greater than 0"),
        ("cloud_model", "", "at least 1 character"),
    ],
)
def test_invalid_values_name_field_and_bound(field: str, value: Any, message: str) -> None:
    with pytest.raises(ValidationError) as info:
        FusionContext(**{field: value})
    text = str(info.value)
    assert field in text
    assert message in text


def test_assignment_is_validated() -> None:
    context = FusionContext()
    with pytest.raises(ValidationError, match="cloud_share"):
        context.cloud_share = 150


def test_ensure_context() -> None:
    given = FusionContext(cloud_share=40)
    assert ensure_context(given) is given
    assert ensure_context(None) == FusionContext()
    assert ensure_context({"mode": "local"}).mode == "local"
    with pytest.raises(ValidationError, match="mode"):
        ensure_context({"mode": "x"})


async def test_graph_run_with_an_invalid_context_raises() -> None:
    model = scripted("any", ["never"])
    graph = build_graph(cloud_model=model, local_model=model, tools=[])
    with pytest.raises(ValidationError) as info:
        # A raw dict, as the LangGraph server passes it: the graph must validate it at run time.
        await graph.ainvoke(user_input("hi"), context={"cloud_share": 150})  # type: ignore[call-overload]
    assert "cloud_share" in str(info.value)
    assert model.prompts == []


# --------------------------------------------------------------------------- docs


def test_context_fields_match_the_dataclass() -> None:
    rows = context_fields()
    assert [row[0] for row in rows] == FIELD_NAMES
    defaults = FusionContext()
    for name, kind, default, description in rows:
        assert default == getattr(defaults, name) == DEFAULTS[name], name
        assert kind and kind != "?", name
        assert description.strip(), f"{name} has no description"
    kinds = {row[0]: row[1] for row in rows}
    assert kinds["mode"] == "cloud | local | fusion"
    assert kinds["cloud_share"] == "integer"
    assert kinds["cloud_base_url"] == "string | null"


def test_readme_has_a_row_for_every_field() -> None:
    text = README.read_text(encoding="utf-8")
    rows = [line for line in text.splitlines() if line.lstrip().startswith("|")]
    missing = [
        name for name in FIELD_NAMES if not any(re.match(rf"\|\s*`?{name}`?\s*\|", row) for row in rows)
    ]
    assert not missing, f"README.md has no configuration table row for: {', '.join(missing)}"


# --------------------------------------------------------------------------- isolation (conftest.py)


def test_fusion_env_is_cleared_for_each_test() -> None:
    assert not [name for name in os.environ if name.startswith("FUSION_")]
    assert FusionContext() == FusionContext(**DEFAULTS)


@pytest.mark.parametrize(
    ("family", "address", "allowed"),
    [
        (socket.AF_INET, ("127.0.0.1", 80), True),
        (socket.AF_INET, ("127.8.9.10", 80), True),
        (socket.AF_INET6, ("::1", 80, 0, 0), True),
        (socket.AF_INET6, ("::ffff:127.0.0.1", 80, 0, 0), True),
        (socket.AF_UNIX, "/tmp/some.sock", True),
        (socket.AF_INET, ("203.0.113.7", 443), False),
        (socket.AF_INET, ("10.0.0.1", 80), False),
        (socket.AF_INET6, ("2001:db8::1", 443, 0, 0), False),
        (socket.AF_INET, ("api.openai.com", 443), False),
    ],
)
def test_loopback_classification(family: int, address: object, allowed: bool) -> None:
    assert is_loopback(family, address) is allowed


def test_non_loopback_connections_are_refused() -> None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        with pytest.raises(NetworkBlockedError, match="loopback only"):
            sock.connect(("203.0.113.7", 443))
        with pytest.raises(NetworkBlockedError):
            sock.connect_ex(("203.0.113.7", 443))
    finally:
        sock.close()


def test_loopback_connections_still_work() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port), timeout=5) as client:
            assert client.getpeername()[1] == port


def test_readme_table_is_generated_from_the_context() -> None:
    from fusion_graph.docs import render_readme_table

    text = README.read_text(encoding="utf-8")
    assert render_readme_table(text) == text, (
        "README table is stale: run `python -m fusion_graph.docs README.md`"
    )
