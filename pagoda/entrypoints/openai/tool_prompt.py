"""The fallback tool prompt, for chat templates that cannot render `tools` (SmolLM2's prints
only roles and contents): the tools are described in a system-message block, in the hermes
format Qwen2.5's template uses, and the conversation's tool traffic is written as text in the
same format, so the model sees one convention throughout:

    # Tools

    You may call one or more functions to assist with the user query.

    You are provided with function signatures within <tools></tools> XML tags:
    <tools>
    {"type": "function", "function": {"name": ..., "description": ..., "parameters": ...}}
    </tools>

    For each function call, return a json object with function name and arguments within
    <tool_call></tool_call> XML tags:
    <tool_call>
    {"name": <function-name>, "arguments": <args-json-object>}
    </tool_call>

The block is appended to the first system message (or is one, put first); an assistant
message's tool_calls become `<tool_call>` blocks after its content; a tool result becomes a
user message `<tool_response>...</tool_response>`. All of it is message content, which
render_chat tokenizes as text (it can forge no control token). Answers to a request rendered
this way are parsed with the hermes parser, whatever --tool-call-parser says."""

from __future__ import annotations

import json
import logging
from typing import Any

from pagoda.engine.chat import Conversation

logger = logging.getLogger(__name__)

_INSTRUCTIONS = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)
_logged = False


def tool_block(tools: tuple[dict[str, Any], ...]) -> str:
    """The system-message block that describes the tools and the call format."""
    return _INSTRUCTIONS.format(tools="\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools))


def with_tool_prompt(conversation: Conversation, tools: tuple[dict[str, Any], ...]) -> Conversation:
    """`conversation` (template messages: tool_calls' arguments as objects) with the tool
    block in its system message and its tool calls and results written as text."""
    _log_once()
    messages = [_as_text(message) for message in conversation]
    block = tool_block(tools)
    if messages and messages[0]["role"] == "system":
        first = messages[0]
        messages[0] = {**first, "content": f"{first['content']}\n\n{block}" if first["content"] else block}
    else:
        messages.insert(0, {"role": "system", "content": block})
    return messages


def _as_text(message: dict[str, Any]) -> dict[str, Any]:
    if message["role"] == "tool":
        return {"role": "user", "content": f"<tool_response>\n{message['content']}\n</tool_response>"}
    if not message.get("tool_calls"):
        return message
    calls = [
        "<tool_call>\n"
        + json.dumps({"name": call["function"]["name"], "arguments": call["function"]["arguments"]}, ensure_ascii=False)
        + "\n</tool_call>"
        for call in message["tool_calls"]
    ]
    text = "\n".join(([message["content"]] if message["content"] else []) + calls)
    return {key: value for key, value in message.items() if key != "tool_calls"} | {"content": text}


def _log_once() -> None:
    global _logged
    if not _logged:
        _logged = True
        logger.info(
            "the chat template does not render tools: requests with tools use the fallback tool prompt "
            "(a system-message block in the hermes <tool_call> format; see tool_prompt.py)"
        )
