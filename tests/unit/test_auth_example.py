"""The shipped auth example: tokens to identities, and the store scoped to the caller's own memories."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
from langgraph_sdk import Auth

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "auth.py"


def load_example() -> Any:
    """The auth file as the server loads it: by path (``langgraph.json``'s ``auth.path``)."""
    spec = importlib.util.spec_from_file_location("fusion_auth_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


example = load_example()
authenticate, scoped_namespace = example.authenticate, example.scoped_namespace


async def test_a_bearer_token_names_its_user_and_anything_else_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("FUSION_EXAMPLE_TOKENS", json.dumps({"tok-a": "alice", "tok-b": "bob"}))
    assert (await authenticate("Bearer tok-a"))["identity"] == "alice"
    for header in (None, "", "Bearer nope", "Basic tok-a"):
        with pytest.raises(Auth.exceptions.HTTPException):
            await authenticate(header)


def test_the_store_reaches_only_the_callers_own_memories_and_job_log() -> None:
    own = ("fusion_memories", "fusion", "alice")
    assert scoped_namespace(own, "alice") == own
    assert scoped_namespace(("fusion_jobs", "fusion", "alice"), "alice") == ("fusion_jobs", "fusion", "alice")
    for other in (
        ("fusion_memories", "fusion", "bob"),
        ("fusion_jobs", "fusion", "bob"),
        ("fusion_memories",),
    ):
        with pytest.raises(Auth.exceptions.HTTPException):
            scoped_namespace(other, "alice")
    assert scoped_namespace(("notes",), "alice") == ("alice", "notes")
