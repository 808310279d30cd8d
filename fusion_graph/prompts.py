"""Prompt text used by the graph's nodes."""

# NOTE: planning guidance lives in the system prompt, not in a plan-only message:
# every step of a turn must share the same prefix, or llama-server's prefix cache
# breaks at the first differing token.
SYSTEM_PROMPT = (
    "You are a careful software agent working in a project workspace. When a new user "
    "request arrives, first state a short numbered plan, then issue the first batch of tool "
    "calls it needs (or answer directly if no tool is needed). Use the tools to inspect and "
    "change files; prefer small, verifiable steps. When the task is done, reply to the user "
    "without calling a tool."
)

LOOP_CORRECTION = (
    "Loop detected: the call {name}({args}) has now been requested {count} times in this "
    "turn with identical arguments, so it was not run again. Use the earlier result, or "
    "change approach."
)

TRIMMED = (
    "Not executed: this step asked for {requested} tool calls and at most {limit} run per "
    "step. Re-issue this call in the next step if it is still needed."
)

STEP_LIMIT = (
    "I stopped after {max_steps} steps without finishing (the step limit of this turn). "
    "Send another message to continue from here."
)

REPAIR_EXHAUSTED = (
    "I could not produce a valid tool call after {attempts} repair attempts, so this turn "
    "ended here. Last error: {error}"
)

OVER_BUDGET = (
    "I stopped here: the next step needs the cloud model ({fit}) and the cloud budget does not "
    "allow it ({why}). Raise the budget, start a new thread, or send a shorter request."
)

# NOTE: appended after the conversation for the re-synthesis call (cloud), so its prefix is the
# one the cloud steps sent.
RESYNTHESIZE = (
    "Write the final reply to the user's last request now, from the conversation above (a draft "
    "was written but is not shown). Do not call tools. Reply to the user directly."
)

# NOTE: sent after the whole conversation (the same prefix the steps send, so llama-server
# reuses its cache); it asks about the latest part, since earlier turns have had their jobs.
MEMORY_INSTRUCTIONS = (
    "Memory job: do not call tools and do not continue the task. You maintain the long-term "
    "memory of the software agent above. From the latest part of the conversation (since the "
    "user's last request), list what is worth remembering in later conversations: durable "
    "facts about the user or the project, decisions taken, and tasks left open. Skip anything "
    "transient. Reply with JSON only, matching the schema; an empty list is a fine answer."
)

MEMORY_REPAIR = (
    "Your previous answer was not valid for the schema: {error}. Reply again with JSON only, "
    "matching the schema exactly."
)

#: ``name`` of the message that carries recalled memories into a turn.
MEMORY_MESSAGE_NAME = "recalled_memories"

RECALLED_MEMORIES = "Relevant memories from earlier conversations (most relevant first):\n{items}"
