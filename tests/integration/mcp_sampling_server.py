"""A real MCP server over stdio whose tool asks its client to sample (``sampling/createMessage``).

Run as ``python mcp_sampling_server.py``; ``tests/integration/test_mcp_sampling.py``
starts it through ``langchain-mcp-adapters``. The tool ``summarize`` sends one
user message with the given preferences and returns, as JSON, what the client's
model said, which model (provider id) answered and why it stopped; a refused
request comes back as ``{"error": ...}`` so the test can read the client's error text.
"""

from __future__ import annotations

import json

from mcp.server.fastmcp import Context, FastMCP
from mcp.shared.exceptions import McpError
from mcp.types import ModelPreferences, SamplingMessage, TextContent

#: Starts every sampled prompt, so a fake provider can tell a sampling request from an agent step.
MARKER = "SAMPLING REQUEST:"

server = FastMCP("fusion-sampling-test", log_level="WARNING")


@server.tool()
async def summarize(
    text: str,
    ctx: Context,  # type: ignore[type-arg]  # FastMCP injects it; its parameters are the SDK's own
    intelligence: float = 0.0,
    cost: float = 0.0,
    speed: float = 0.0,
    max_tokens: int = 8,
    stop: list[str] | None = None,
) -> str:
    """Ask the client's model to summarize ``text``; JSON with ``text``, ``model``, ``stop_reason``."""
    try:
        result = await ctx.session.create_message(
            messages=[
                SamplingMessage(role="user", content=TextContent(type="text", text=f"{MARKER} {text}"))
            ],
            max_tokens=max_tokens,
            system_prompt="Summarize in a few words.",
            model_preferences=ModelPreferences(
                intelligencePriority=intelligence, costPriority=cost, speedPriority=speed
            ),
            stop_sequences=stop,
        )
    except McpError as error:
        return json.dumps({"error": error.error.message, "code": error.error.code})
    content = result.content
    sampled = content.text if isinstance(content, TextContent) else str(content)
    return json.dumps({"text": sampled, "model": result.model, "stop_reason": result.stopReason})


if __name__ == "__main__":
    server.run("stdio")
