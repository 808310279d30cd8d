"""A single-leg mode means what it says: ``mode="local"`` never calls a cloud provider, and back."""

from __future__ import annotations

import pytest
from langchain_openai import ChatOpenAI

from fusion_graph import ChainExhausted, ChatLlamaServer, FusionContext, FusionSettings, build_graph
from fusion_graph_testing.fake_openai import FakeOpenAI, Reply
from fusion_graph_testing.llama_server import free_port
from tests.plugins.fakes import user_input


def models(cloud: FakeOpenAI, local_url: str) -> tuple[ChatOpenAI, ChatLlamaServer]:
    return (
        ChatOpenAI(model="c", base_url=cloud.base_url, api_key="x", max_retries=0),
        ChatLlamaServer(model="l", base_url=local_url, api_key="x", max_retries=0, timeout=2),
    )


@pytest.mark.parametrize("way", ["ainvoke", "messages"])
async def test_local_mode_with_its_server_down_never_reaches_the_cloud(way: str) -> None:
    dead = f"http://127.0.0.1:{free_port()}/v1"
    with FakeOpenAI([Reply(content="cloud answer")]) as cloud:
        cloud_model, local_model = models(cloud, dead)
        graph = build_graph(cloud_model=cloud_model, local_model=local_model, tools=[])
        context = FusionContext(mode="local", sub_runners="off")
        with pytest.raises(ChainExhausted, match="local:l"):
            if way == "ainvoke":
                await graph.ainvoke(user_input("private"), context=context)
            else:
                async for _ in graph.astream(user_input("private"), context=context, stream_mode="messages"):
                    pass
        assert cloud.requests == [], "a mode=local run called the cloud"


async def test_cloud_mode_never_asks_the_local_server_and_the_operator_may_allow_fallover() -> None:
    with FakeOpenAI([Reply(status=500)]) as cloud, FakeOpenAI([Reply(content="local answer")]) as local:
        cloud_model, local_model = models(cloud, local.base_url)
        strict = build_graph(cloud_model=cloud_model, local_model=local_model, tools=[])
        with pytest.raises(ChainExhausted):
            await strict.ainvoke(user_input("hi"), context=FusionContext(mode="cloud", sub_runners="off"))
        assert local.requests == []
        lenient = build_graph(
            cloud_model=cloud_model,
            local_model=local_model,
            tools=[],
            settings=FusionSettings(cross_leg_fallover=True),
        )
        out = await lenient.ainvoke(user_input("hi"), context=FusionContext(mode="cloud", sub_runners="off"))
        assert out["messages"][-1].content == "local answer"
        assert (out["route_log"][0]["routed_leg"], out["route_log"][0]["leg"]) == ("cloud", "local")
