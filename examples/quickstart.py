"""Quick start: one turn of the fusion graph, then where each step ran and why.

Needs the cloud key (``OPENAI_API_KEY``, in the environment or in ``.env``) and a
llama-server at ``FUSION_LOCAL_BASE_URL`` (default ``http://127.0.0.1:8080/v1``).
"""

import asyncio

from langchain_core.messages import HumanMessage
from langgraph.checkpoint.memory import InMemorySaver

from fusion_graph import FusionContext, FusionSettings, build_graph


async def main() -> None:
    """Run one turn and print its answer and route log."""
    graph = build_graph(
        checkpointer=InMemorySaver(),  # or a SQLite/Postgres saver
        settings=FusionSettings(workspace_root="."),  # operator settings; else FUSION_* and .env
    )
    result = await graph.ainvoke(
        {"messages": [HumanMessage("List the files here and say what this project is")]},
        {"configurable": {"thread_id": "ticket-42"}},
        context=FusionContext(cloud_share=30, sub_runners="off"),  # per-run choices only
    )
    print(result["messages"][-1].content)
    for record in result["route_log"]:
        # routed_leg: where the router sent the step; leg: where it ran (after a fallover, the other).
        print(record["step"], record["kind"], record["routed_leg"], "->", record["leg"], record["provider"])
        print("   ", record["reason"])


if __name__ == "__main__":
    asyncio.run(main())
