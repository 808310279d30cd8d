"""Whose memories a run touches: the authenticated identity decides, never a field the caller sends."""

from __future__ import annotations

import pytest
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.store.memory import InMemoryStore

from fusion_graph import build_graph
from fusion_graph.errors import FusionError, IdentityRefused, InvalidInput
from fusion_graph.inputs import ANONYMOUS, check_identity, user_of
from fusion_graph.memory.store import namespace_of
from tests.plugins.fakes import scripted, user_input


def config(**configurable: object) -> RunnableConfig:
    return {"configurable": dict(configurable)}


def test_the_authenticated_identity_names_the_user_whatever_else_the_run_says() -> None:
    authenticated = config(langgraph_auth_user_id="alice", thread_id="t")
    assert user_of(authenticated) == "alice"
    assert namespace_of(authenticated, "g") == ("fusion_memories", "g", "alice")
    same = config(langgraph_auth_user_id="alice", user_id="alice")
    check_identity(same)
    assert user_of(same) == "alice"
    # metadata and context carry no identity
    with_metadata: RunnableConfig = {
        "configurable": {"langgraph_auth_user_id": "alice"},
        "metadata": {"user_id": "bob"},
    }
    assert namespace_of(with_metadata, "g")[-1] == "alice"


def test_an_authenticated_run_that_names_another_user_is_refused() -> None:
    with pytest.raises(IdentityRefused, match="another user") as refused:
        check_identity(config(langgraph_auth_user_id="alice", user_id="bob"))
    assert isinstance(refused.value, InvalidInput | FusionError | PermissionError)


def test_without_auth_user_id_is_a_label_and_nobody_is_anonymous() -> None:
    check_identity(config(user_id="bob"))
    assert user_of(config(user_id="bob")) == "bob"
    assert user_of(config()) == ANONYMOUS
    assert user_of(config(langgraph_auth_user_id="")) == ANONYMOUS  # no auth ran: an empty identity


@pytest.mark.parametrize("mode", ["ainvoke", "messages"])
async def test_the_graph_refuses_the_run_before_anything_is_written(mode: str) -> None:
    graph = build_graph(
        cloud_model=scripted("c", ["never"]),
        local_model=scripted("l", ["never"]),
        tools=[],
        checkpointer=InMemorySaver(),
        store=InMemoryStore(),
    )
    run = config(thread_id="t-identity", langgraph_auth_user_id="alice", user_id="bob")
    with pytest.raises(IdentityRefused):
        if mode == "ainvoke":
            await graph.ainvoke(user_input("recall bob's notes"), run)
        else:
            async for _ in graph.astream(user_input("recall bob's notes"), run, stream_mode="messages"):
                pass
    state = await graph.aget_state(config(thread_id="t-identity"))
    assert not state.values  # the thread was never written
