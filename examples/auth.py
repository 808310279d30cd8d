"""An auth file an operator can start from: bearer tokens, owner-scoped threads and memories.

Point ``langgraph.json`` at it (``"auth": {"path": "./examples/auth.py:auth"}``)
and set ``FUSION_EXAMPLE_TOKENS`` to a JSON object of token -> user id (a real
deployment verifies its tokens with its identity provider instead). Then:

- every request needs ``Authorization: Bearer <token>``; the user id becomes the
  run's ``langgraph_auth_user_id``, which alone decides whose memories a run
  recalls and writes (``fusion_graph.inputs.user_of``); a run whose
  ``configurable.user_id`` names someone else is refused by the graph;
- threads (with their runs) and crons carry an ``owner`` and each user sees
  only their own; assistants, which the operator makes, stay readable by all;
- the store API reaches only the caller's own memories and job log: a namespace
  ``(fusion_memories | fusion_jobs, <assistant>, <user>)`` whose user is not the
  caller's is refused, and any other namespace is put under the caller's id.
"""

from __future__ import annotations

import json
import os
from typing import Any

from langgraph_sdk import Auth

auth = Auth()

#: The store roots whose third label is the user the memories are about (``fusion_graph.memory.store``).
USER_SCOPED_ROOTS = ("fusion_memories", "fusion_jobs", "fusion_shadows")


def _tokens() -> dict[str, str]:
    raw = os.environ.get("FUSION_EXAMPLE_TOKENS", "{}")
    try:
        tokens = json.loads(raw)
    except ValueError:
        raise RuntimeError("FUSION_EXAMPLE_TOKENS must be a JSON object of token -> user id") from None
    return {str(token): str(user) for token, user in dict(tokens).items()}


@auth.authenticate
async def authenticate(authorization: str | None) -> Auth.types.MinimalUserDict:
    """The user a bearer token stands for; 401 for anything else."""
    scheme, _, token = (authorization or "").partition(" ")
    user = _tokens().get(token) if scheme.lower() == "bearer" else None
    if not user:
        raise Auth.exceptions.HTTPException(status_code=401, detail="a valid bearer token is required")
    return {"identity": user, "permissions": []}


@auth.on.threads
async def own_threads(ctx: Auth.types.AuthContext, value: Any) -> Auth.types.FilterType:
    """Threads (and so their runs): stamp the owner on what is made, and show only one's own."""
    _stamp_owner(ctx, value)
    return {"owner": ctx.user.identity}


@auth.on.crons
async def own_crons(ctx: Auth.types.AuthContext, value: Any) -> Auth.types.FilterType:
    """Crons, likewise: each user's own."""
    _stamp_owner(ctx, value)
    return {"owner": ctx.user.identity}


def _stamp_owner(ctx: Auth.types.AuthContext, value: Any) -> None:
    metadata = value.setdefault("metadata", {}) if isinstance(value, dict) else None
    if isinstance(metadata, dict):
        metadata["owner"] = ctx.user.identity


def scoped_namespace(namespace: tuple[str, ...], user: str) -> tuple[str, ...]:
    """``namespace`` as ``user`` may reach it; raises 403 for another user's memories.

    Pure, so it is tested on its own (``tests/unit/test_auth_example.py``).
    """
    if namespace and namespace[0] in USER_SCOPED_ROOTS:
        if len(namespace) >= 3 and namespace[2] != user:
            raise Auth.exceptions.HTTPException(status_code=403, detail="another user's memories")
        if len(namespace) < 3:  # a search or listing over every user's memories: narrowed to none
            raise Auth.exceptions.HTTPException(
                status_code=403, detail="name the assistant and your own user id in the namespace"
            )
        return namespace
    if not namespace or namespace[0] != user:
        return (user, *namespace)
    return namespace


@auth.on.store
async def own_store(ctx: Auth.types.AuthContext, value: Any) -> None:
    """Every store call reaches only the caller's own namespaces."""
    namespace = tuple(value.get("namespace") or ())
    value["namespace"] = scoped_namespace(namespace, ctx.user.identity)
