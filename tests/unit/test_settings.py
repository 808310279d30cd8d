"""Operator settings: the environment, the secret key, validation, and what a run may narrow."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from fusion_graph.errors import ContextError
from fusion_graph.settings import FusionSettings


@pytest.mark.parametrize(
    ("env", "value", "field", "expected"),
    [
        ("FUSION_CLOUD_MODEL", "gpt-4o", "cloud_model", "gpt-4o"),
        ("FUSION_CLOUD_MODELS", '["gpt-4o", "gpt-4.1"]', "cloud_models", ("gpt-4o", "gpt-4.1")),
        ("FUSION_REQUEST_TIMEOUT", "2.5", "request_timeout", 2.5),
        ("FUSION_LOCAL_SLOTS", "4", "local_slots", 4),
        ("FUSION_LOCAL_WINDOW_TOKENS", "8192", "local_window_tokens", 8192),
        ("FUSION_CLOUD_WINDOW_TOKENS", "200000", "cloud_window_tokens", 200000),
        ("FUSION_WORKSPACE_ROOT", "/srv/ws", "workspace_root", "/srv/ws"),
        ("FUSION_PRICE_OVERRIDES", '{"m": [1, 2, null]}', "price_overrides", {"m": (1.0, 2.0, None)}),
    ],
)
def test_operator_settings_come_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, env: str, value: str, field: str, expected: object
) -> None:
    monkeypatch.setenv(env, value)
    actual = getattr(FusionSettings(), field)
    assert actual == expected
    assert type(actual) is type(expected)


def test_the_cloud_key_is_a_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-secret-value")
    settings = FusionSettings()
    key = settings.api_key()
    assert key is not None and key.get_secret_value() == "sk-test-secret-value"
    assert "sk-test-secret-value" not in repr(settings) + str(key)
    monkeypatch.setenv("FUSION_CLOUD_API_KEY", "sk-direct-value")
    direct = FusionSettings().api_key()
    assert direct is not None and direct.get_secret_value() == "sk-direct-value"
    assert "sk-direct-value" not in repr(FusionSettings())


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("request_timeout", 0, "must be greater than 0 and at most 3600 seconds"),
        ("request_timeout", float("inf"), "must be greater than 0 and at most 3600 seconds"),
        ("memory_timeout_s", -1, "must be greater than 0"),
        ("provider_cooldown_s", 1e9, "must be between 0 and 3600"),
        ("local_price_per_mtok", (-1, -1), "prices must be between 0 and"),
        ("cloud_model", "", "at least 1 character"),
        ("local_slots", True, "must be a number, got the boolean True"),
    ],
)
def test_invalid_operator_settings_name_field_and_bound(field: str, value: Any, message: str) -> None:
    with pytest.raises(ValidationError) as info:
        FusionSettings(**{field: value})
    text = str(info.value)
    assert field in text
    assert message in text


def test_a_run_may_narrow_the_workspace_and_pick_an_allowed_model(tmp_path: Path) -> None:
    inner = tmp_path / "project"
    inner.mkdir()
    settings = FusionSettings(workspace_root=str(tmp_path), cloud_models=("gpt-4o",))
    narrowed = settings.narrow(cloud_model="gpt-4o", workspace_root="project")
    assert narrowed.workspace_root == str(inner.resolve())
    assert narrowed.cloud_model == "gpt-4o"
    assert settings.narrow() is settings
    with pytest.raises(ContextError, match="lies outside the operator's workspace"):
        settings.narrow(workspace_root="/etc")
    with pytest.raises(ContextError, match="lies outside the operator's workspace"):
        settings.narrow(workspace_root="../")
    with pytest.raises(ContextError, match=r"cloud_model 'o1-pro' is not allowed .*'gpt-4o-mini', 'gpt-4o'"):
        settings.narrow(cloud_model="o1-pro")
