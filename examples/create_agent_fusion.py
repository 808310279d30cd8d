"""An existing ``create_agent`` agent made fusion-routed by one line: each model call to local or cloud.

Needs what the quick start needs: the cloud key (``OPENAI_API_KEY``, or ``FUSION_CLOUD_API_KEY``)
and a llama-server at ``FUSION_LOCAL_BASE_URL``. ``langgraph dev`` can serve ``agent`` from a
``langgraph.json``. The agent's own model is the graph's cloud model, built from the same settings
(its key, endpoint and timeout), so wherever the settings find the key, the agent has it too.
"""

import asyncio

from langchain.agents import create_agent
from langchain_core.messages import HumanMessage

from fusion_graph import FusionSettings, make_workspace_tools
from fusion_graph.middleware import FusionRoutingMiddleware
from fusion_graph.providers.models import build_cloud_model

settings = FusionSettings(workspace_root=".")  # operator settings; else FUSION_* and .env
agent = create_agent(
    model=build_cloud_model(settings),  # the agent's own model: the graph's cloud model
    tools=make_workspace_tools(settings=settings),
    middleware=[FusionRoutingMiddleware(settings=settings, context={"cloud_share": 30})],  # the one line
)


async def main() -> None:
    """Run one turn and print its answer and route log."""
    result = await agent.ainvoke(
        {"messages": [HumanMessage("List the files here and say what this project is")]},
        {"configurable": {"thread_id": "ticket-42"}},  # the thread keeps its llama-server slot
    )
    print(result["messages"][-1].content)
    for record in result["route_log"]:
        print(record["step"], record["kind"], record["routed_leg"], "->", record["leg"], record["provider"])
        print("   ", record["reason"])


if __name__ == "__main__":
    asyncio.run(main())
