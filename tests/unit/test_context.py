"""The runtime context: defaults, environment fallbacks, validation and the docs table."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from fusion_graph import prompts
from fusion_graph.agent import build_graph
from fusion_graph.context import DEFAULTS, ENV_KEYS, FusionContext, context_fields, ensure_context
from fusion_graph.errors import ContextError
from fusion_graph.settings import FusionSettings
from tests.plugins.fakes import scripted, user_input

CONFIGURATION = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
FIELD_NAMES = [f.name for f in dataclasses.fields(FusionContext)]


def test_defaults() -> None:
    context = FusionContext()
    assert context.mode == "fusion"
    assert context.cloud_share == 30
    assert context.hysteresis == 10
    assert context.max_steps == 25
    assert context.conversation_max_tokens is None  # the local window, found at run time
    assert (context.max_completion_tokens, context.max_tool_output_tokens) == (4096, 8000)
    assert context.max_tool_calls_per_step == 8
    assert context.loop_repeat_limit == 3
    assert context.max_repair_attempts == 2
    assert context.system_prompt == prompts.SYSTEM_PROMPT
    assert (context.cloud_model, context.workspace_root) == (None, None), "nothing narrowed"
    settings = FusionSettings()
    assert settings.cloud_api_key_env == "OPENAI_API_KEY"
    assert settings.local_base_url.endswith("/v1")
    assert settings.workspace_root == "."


def test_every_field_defaults_to_its_documented_default() -> None:
    context = FusionContext()
    assert set(DEFAULTS) == set(ENV_KEYS.values())
    assert {name: getattr(context, name) for name in FIELD_NAMES} == {
        name: DEFAULTS[ENV_KEYS[name]] for name in FIELD_NAMES
    }


def test_env_names_follow_the_prefix() -> None:
    names = FusionContext().env_names
    assert names["cloud_share"] == "FUSION_CLOUD_SHARE"
    assert set(names) == set(FIELD_NAMES)
    # The narrowing fields never read the operator's own variables.
    assert names["cloud_model"] == "FUSION_RUN_CLOUD_MODEL"
    assert names["workspace_root"] == "FUSION_RUN_WORKSPACE_ROOT"


def run_python(code: str, **env: str) -> str:
    """Output of ``code`` in a fresh interpreter with ``env`` (context defaults are read at import)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("FUSION_")}
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=clean | env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    return done.stdout.strip() + done.stderr.strip()


def test_importing_never_reads_the_run_defaults() -> None:
    code = "from fusion_graph.context import FusionContext; print(FusionContext().cloud_share)"
    assert run_python(code, FUSION_CLOUD_SHARE="abc") == "30"  # a bad one no longer breaks the import


def test_run_defaults_set_after_import_are_read_when_the_graph_is_built(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("FUSION_CLOUD_SHARE", "55")
    monkeypatch.setenv("FUSION_MODE", "local")
    monkeypatch.setenv("FUSION_MAX_STEPS", "7")
    graph = build_graph(cloud_model=scripted("cloud", []), local_model=scripted("local", []))
    assert graph.run_defaults == {"cloud_share": 55, "mode": "local", "max_steps": 7}
    schema = graph.get_context_jsonschema()
    assert schema is not None
    shown = {name: schema["properties"][name]["default"] for name in ("cloud_share", "mode", "max_steps")}
    assert shown == {"cloud_share": 55, "mode": "local", "max_steps": 7}  # what Studio renders
    # A built graph keeps what it read, as it keeps its operator settings.
    monkeypatch.setenv("FUSION_CLOUD_SHARE", "10")
    assert graph.run_defaults["cloud_share"] == 55


async def test_a_run_takes_the_defaults_and_its_own_context_overrides_them_field_by_field(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("FUSION_MODE", "local")
    monkeypatch.setenv("FUSION_CLOUD_SHARE", "55")
    cloud, local = scripted("cloud", ["from cloud"] * 2), scripted("local", ["from local"] * 2)
    graph = build_graph(cloud_model=cloud, local_model=local)
    plain = await graph.ainvoke(user_input("hi"))
    assert [r["leg"] for r in plain["route_log"]] == ["local"] and cloud.prompts == []
    mixed = await graph.ainvoke(user_input("hi"), context={"mode": "cloud"})  # type: ignore[call-overload]
    assert [r["leg"] for r in mixed["route_log"]] == ["cloud"]
    assert ensure_context({"hysteresis": 4}, graph.run_defaults) == FusionContext(
        mode="local", cloud_share=55, hysteresis=4
    )


@pytest.mark.parametrize(
    ("variable", "value", "says"),
    [
        ("FUSION_CLOUD_SHARE", "abc", "valid integer"),
        ("FUSION_CLOUD_SHARE", "150", "must be between 0 and 100"),
        ("FUSION_MAX_STEPS", "0", "between 1 and 1000"),
    ],
)
def test_a_bad_run_default_set_after_import_is_refused_when_the_graph_is_built(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str, says: str
) -> None:
    monkeypatch.setenv(variable, value)
    field = variable.removeprefix("FUSION_").lower()
    with pytest.raises(ContextError, match=rf"{variable} \({field}\): .*{says}"):
        build_graph(cloud_model=scripted("cloud", []), local_model=scripted("local", []))


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("cloud_share", 150, "must be between 0 and 100, got 150"),
        ("cloud_share", -1, "must be between 0 and 100, got -1"),
        ("cloud_share", True, "must be a number, got the boolean True"),
        ("mode", "x", "'cloud', 'local' or 'fusion'"),
        ("max_steps", 0, "must be between 1 and 1000"),
        ("hysteresis", 51, "must be between 0 and 50"),
        ("conversation_max_tokens", 100, "must be between 256 and"),
        ("max_completion_tokens", 8, "must be between 16 and"),
        ("max_tool_output_tokens", 50, "must be between 100 and"),
        ("loop_repeat_limit", 1, "must be between 2 and 100"),
        ("max_tool_calls_per_step", 0, "must be between 1 and 128"),
        ("max_repair_attempts", 11, "must be between 0 and 10"),
        ("max_steps", float("inf"), "must be between 1 and 1000"),
    ],
)
def test_invalid_values_name_field_and_bound(field: str, value: Any, message: str) -> None:
    with pytest.raises(ContextError) as info:
        ensure_context({field: value})
    text = str(info.value)
    assert field in text
    assert message in text


def test_assignment_is_validated() -> None:
    context = FusionContext()
    with pytest.raises(ValidationError, match="cloud_share"):
        context.cloud_share = 150


def test_ensure_context() -> None:
    given = FusionContext(cloud_share=40)
    assert ensure_context(given) == given
    resolved = ensure_context(given)
    assert ensure_context(resolved) is resolved, "a resolved context is taken as it is"
    assert ensure_context(None) == FusionContext()
    assert ensure_context({"mode": "local"}).mode == "local"
    with pytest.raises(ContextError, match="mode"):
        ensure_context({"mode": "x"})


@pytest.mark.parametrize(
    ("context", "message"),
    [
        ({"cloud_shar": 40}, "cloud_shar: Unexpected keyword argument"),
        ("abc", "must be an object of run settings"),
        ({"cloud_base_url": "http://127.0.0.1:9/v1"}, "cloud_base_url is an operator setting"),
        ({"cloud_api_key_env": "HOME"}, "cloud_api_key_env is an operator setting"),
        ({"request_timeout": 5}, "request_timeout is an operator setting"),
        ({"price_overrides": {}}, "price_overrides is an operator setting"),
    ],
    ids=["typo", "not-an-object", "endpoint", "key-variable", "timeout", "prices"],
)
def test_unknown_keys_operator_settings_and_wrong_shapes_are_refused(context: Any, message: str) -> None:
    with pytest.raises(ContextError, match=message):
        ensure_context(context)


async def test_graph_run_with_an_invalid_context_raises_before_any_model_call() -> None:
    model = scripted("any", ["never"])
    graph = build_graph(cloud_model=model, local_model=model, tools=[])
    for context in ({"cloud_share": 150}, {"local_base_url": "http://127.0.0.1:9/v1"}, "abc"):
        with pytest.raises(ContextError) as info:
            # A raw value, as the LangGraph server passes it: the graph must validate it at run time.
            await graph.ainvoke(user_input("hi"), context=context)  # type: ignore[call-overload]
        assert (
            "cloud_share" in str(info.value)
            or "operator setting" in str(info.value)
            or "object" in str(info.value)
        )
    assert model.prompts == []


async def test_a_run_cannot_widen_the_workspace(tmp_path: Path) -> None:
    model = scripted("any", ["never"])
    settings = FusionSettings(workspace_root=str(tmp_path))
    graph = build_graph(cloud_model=model, local_model=model, settings=settings)
    with pytest.raises(ContextError, match="'/etc' lies outside the operator's workspace"):
        await graph.ainvoke(user_input("hi"), context={"workspace_root": "/etc"})  # type: ignore[call-overload]
    assert model.prompts == []


# --------------------------------------------------------------------------- docs


def test_context_fields_match_the_dataclass() -> None:
    rows = context_fields()
    assert [row[0] for row in rows] == FIELD_NAMES
    defaults = FusionContext()
    for name, kind, default, description in rows:
        assert default == getattr(defaults, name) == DEFAULTS[ENV_KEYS[name]], name
        assert kind and kind != "?", name
        assert description.strip(), f"{name} has no description"
    kinds = {row[0]: row[1] for row in rows}
    assert kinds["mode"] == "cloud | local | fusion"
    assert kinds["cloud_share"] == "integer"
    assert kinds["workspace_root"] == "string | null"


def test_the_configuration_doc_has_a_row_with_the_scope_of_every_field() -> None:
    text = CONFIGURATION.read_text(encoding="utf-8")
    rows = [line for line in text.splitlines() if line.lstrip().startswith("|")]
    expected = [(name, "run") for name in FIELD_NAMES] + [
        (name, "operator") for name in FusionSettings.model_fields
    ]
    missing = [
        f"{name} ({scope})"
        for name, scope in expected
        if not any(re.match(rf"\|\s*`{name}`\s*\|\s*{scope}\s*\|", row) for row in rows)
    ]
    assert not missing, f"docs/configuration.md has no table row for: {', '.join(missing)}"


# --------------------------------------------------------------------------- the calibrated dial's fields


def test_context_takes_a_table_as_json_text() -> None:
    # Text is how FUSION_SCORE_QUANTILES arrives from the environment.
    table = [round(k / 4, 2) for k in range(101)]
    assert FusionContext(score_quantiles=json.dumps(table)).score_quantiles == tuple(table)  # type: ignore[arg-type]
    assert FusionContext(score_quantiles="").score_quantiles is None  # type: ignore[arg-type]


def test_context_refuses_a_decreasing_table() -> None:
    with pytest.raises(ValueError, match="non-decreasing"):
        FusionContext(score_quantiles=(50.0, *([1.0] * 100)))


def test_the_pace_is_off_by_default_and_checked() -> None:
    assert FusionContext().pace_slack is None
    assert FusionContext(pace_slack="").pace_slack is None  # type: ignore[arg-type]  # an empty FUSION_PACE_SLACK
    assert FusionContext(pace_slack="1.5").pace_slack == 1.5  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"between 0\.5 and 100"):
        FusionContext(pace_slack=0.2)


# ------------------------------------------------------------------------ a FusionContext over the defaults


async def test_a_context_object_takes_the_run_defaults_for_the_fields_it_leaves_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from fusion_graph_testing.fake_openai import FakeOpenAI, Reply
    from tests.plugins.served import graph_over

    monkeypatch.setenv("FUSION_MAX_COMPLETION_TOKENS", "32")
    monkeypatch.setenv("FUSION_MODE", "cloud")
    with FakeOpenAI([]) as cloud, FakeOpenAI([Reply(content="one"), Reply(content="two")]) as local:
        graph = graph_over(cloud, local)
        left_out = FusionContext(mode="local", sub_runners="off")
        await graph.ainvoke(user_input("hi"), {"configurable": {"thread_id": "a"}}, context=left_out)
        chosen = FusionContext(mode="local", sub_runners="off", max_completion_tokens=4096)
        await graph.ainvoke(user_input("hi"), {"configurable": {"thread_id": "b"}}, context=chosen)
    # The default the object left out comes from FUSION_MAX_COMPLETION_TOKENS, as for a dict (sent as
    # max_tokens, which langchain-openai writes max_completion_tokens); the mode it set overrides
    # FUSION_MODE; a value it set, even the built-in default, is kept.
    assert [body["max_completion_tokens"] for body in local.requests] == [32, 4096]
    assert cloud.requests == []
    assert (left_out.max_completion_tokens, left_out.mode) == (4096, "local"), (
        "the caller's object is unchanged"
    )


def test_an_object_and_a_dict_resolve_alike_and_an_assigned_field_is_the_callers() -> None:
    defaults = {"max_completion_tokens": 32, "cloud_share": 55, "mode": "cloud"}
    as_object = ensure_context(FusionContext(mode="local"), defaults)
    assert as_object == ensure_context({"mode": "local"}, defaults)
    assert (as_object.mode, as_object.cloud_share, as_object.max_completion_tokens) == ("local", 55, 32)
    assigned = FusionContext()
    assigned.cloud_share = 30  # the built-in default, set on purpose: it stays
    assert ensure_context(assigned, defaults).cloud_share == 30
    assert ensure_context(assigned, defaults).max_completion_tokens == 32
    resolved = ensure_context(FusionContext(mode="local"), defaults)
    assert ensure_context(resolved, {"cloud_share": 1}) is resolved, (
        "a resolved context meets no later defaults"
    )


def test_an_empty_run_default_means_the_built_in_one_from_the_environment_and_dotenv(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from fusion_graph.context import context_defaults

    monkeypatch.chdir(tmp_path)
    empty = {f"FUSION_{key.upper()}": "" for key in ENV_KEYS.values()}
    assert context_defaults(empty) == {}
    (tmp_path / ".env").write_text(
        "FUSION_CONVERSATION_MAX_TOKENS=\nFUSION_CLOUD_SHARE=\nFUSION_MAX_STEPS=7\nFUSION_HYSTERESIS=4\n",
        encoding="utf-8",
    )
    monkeypatch.setenv("FUSION_HYSTERESIS", "6")  # the environment wins over .env
    monkeypatch.setenv("FUSION_SYSTEM_PROMPT", "")
    assert context_defaults() == {"max_steps": 7, "hysteresis": 6}
    assert ensure_context(None).system_prompt == prompts.SYSTEM_PROMPT
