"""An existing ``create_agent`` agent made fusion-routed by one line: each model call to local or cloud.

Needs what the quick start needs: the cloud key (``OPENAI_API_KEY``) and a llama-server
at ``FUSION_LOCAL_BASE_URL``. ``langgraph dev`` can serve ``agent`` from a ``langgraph.json``.
"""

import asyncio

from langchain.agents import create_agent
from langchain_core.messages import HumanMessage
from langchain_openai import ChatOpenAI

from fusion_graph import FusionSettings, make_workspace_tools
from fusion_graph.middleware import FusionRoutingMiddleware

settings = FusionSettings(workspace_root=".")  # operator settings; else FUSION_* and .env
agent = create_agent(
    model=ChatOpenAI(model=settings.cloud_model, base_url=settings.cloud_base_url),  # the agent's own model
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
