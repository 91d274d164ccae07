"""Chat-template rendering that keeps user text as text.

The model's template is rendered with each message's content replaced by a placeholder;
the template's own pieces are tokenized normally (its special tokens become control
tokens), the users' pieces with special-token matching off. So `<|im_start|>` typed by a
user stays plain text and can never forge a role. The other strings a message may carry
(`name`, `tool_calls`, `tool_call_id`: templates print them as they are) must not contain a
special token's text, nor may the tools' definitions (printed as they are too). Messages in OpenAI's shape (assistant `tool_calls`, role "tool") reach
templates that may not know them: a template that leaves a tool message or a tool call out
of its output is refused rather than answered from a conversation it dropped part of.
transformers renders templates in an
`ImmutableSandboxedEnvironment`: a template cannot reach Python internals (`__class__`,
`__globals__`, ...) or mutate what it is given; any failure to render is the input's fault
and is reported as an InvalidRequestError.
"""

from __future__ import annotations

import functools
import inspect
import re
import uuid
from typing import Any

from transformers import PreTrainedTokenizerBase

from pagoda.errors import InvalidRequestError
from pagoda.multimodal.chat import IMAGE_MARKER

Conversation = list[dict[str, Any]]


def render_chat(
    tokenizer: PreTrainedTokenizerBase,
    messages: Conversation,
    add_generation_prompt: bool = True,
    chat_template: str | None = None,
    template_kwargs: dict[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
    image_token_ids: list[int] | None = None,
) -> list[int]:
    """`template_kwargs` are extra template variables; `chat_template` replaces the model's;
    `tools` (OpenAI's tool objects) go to the template's `tools` variable; with `image_token_ids`
    each image marker in a content (pagoda/multimodal/chat.py) becomes those tokens."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages", "messages must be a non-empty list of {'role', 'content'} dicts")
    if chat_template is None and tokenizer.chat_template is None:
        raise InvalidRequestError("messages", "this model has no chat template; send a plain prompt instead")
    marker = f"\x00PAGODA{uuid.uuid4().hex}"
    contents: list[str] = []
    placeholder_messages = []
    special_texts = _special_texts(tokenizer)
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message or not isinstance(message.get("content"), str):
            raise InvalidRequestError(
                f"messages[{i}]", f"messages[{i}] must be a dict with string 'role' and 'content'"
            )
        _check_no_special_text(i, message, special_texts)
        placeholder_messages.append({**message, "content": f"{marker}{len(contents)}{marker}"})
        contents.append(message["content"])
    for i, tool in enumerate(tools or ()):
        _check_no_special_text_in(f"tools[{i}]", tool, special_texts)
    template_kwargs = template_kwargs or {}
    reserved = sorted(set(template_kwargs) & _reserved_names(tokenizer))
    if reserved:
        raise InvalidRequestError(
            "chat_template_kwargs", f"chat_template_kwargs must not set {reserved[0]!r}: it is set by the server"
        )
    try:
        rendered = tokenizer.apply_chat_template(
            placeholder_messages,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            chat_template=chat_template,
            tools=tools,
            **template_kwargs,
        )
    except Exception as error:  # the template and its variables are input; a failure says what broke
        raise _render_error(messages, chat_template, error) from error
    if not isinstance(rendered, str):
        raise InvalidRequestError("chat_template", "the chat template must render to one string")
    _check_tool_messages_rendered(messages, rendered, marker)
    token_ids: list[int] = []
    for i, piece in enumerate(re.split(re.escape(marker) + r"(\d+)" + re.escape(marker), rendered)):
        if not piece:
            continue
        if i % 2 == 0:
            token_ids += tokenizer.encode(piece, add_special_tokens=False)
        else:
            token_ids += _encode_content(tokenizer, contents[int(piece)], image_token_ids)
    return token_ids


def _encode_content(tokenizer: PreTrainedTokenizerBase, content: str, image_token_ids: list[int] | None) -> list[int]:
    """A message's content as plain text, each image marker as the image tokens (when the model takes images)."""
    pieces = content.split(IMAGE_MARKER) if image_token_ids is not None else [content]
    token_ids = tokenizer.encode(pieces[0], add_special_tokens=False, split_special_tokens=True)
    for piece in pieces[1:]:
        token_ids += [*image_token_ids, *tokenizer.encode(piece, add_special_tokens=False, split_special_tokens=True)]
    return token_ids


def _special_texts(tokenizer: PreTrainedTokenizerBase) -> list[str]:
    """The texts the tokenizer turns into special (control) tokens."""
    return [token.content for token in tokenizer.added_tokens_decoder.values() if token.special and token.content]


def _strings(value: Any) -> list[str]:
    """Every string in a JSON-like value."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [text for item in value.values() for text in _strings(item)]
    if isinstance(value, list):
        return [text for item in value for text in _strings(item)]
    return []


def _check_no_special_text(index: int, message: dict[str, Any], special_texts: list[str]) -> None:
    """What a template prints as it is must not forge control tokens (content is kept as text)."""
    for key, value in message.items():
        if key not in ("role", "content"):
            _check_no_special_text_in(f"messages[{index}].{key}", value, special_texts)


def _check_no_special_text_in(field: str, value: Any, special_texts: list[str]) -> None:
    for text in _strings(value):
        special = next((token for token in special_texts if token in text), None)
        if special is not None:
            raise InvalidRequestError(field, f"{field} must not contain the special token {special!r}")


# A tool no template could know of, to see whether a template prints the tools it is given.
_PROBE_TOOL = {"type": "function", "function": {"name": "pagoda_probe_tool_5e1f", "parameters": {"type": "object"}}}


@functools.lru_cache(maxsize=32)
def renders_tools(tokenizer: PreTrainedTokenizerBase, chat_template: str | None = None) -> bool:
    """Whether the template (the model's, or `chat_template`) prints the `tools` it is given:
    SmolLM2's, like many, ignores them, and tools must then reach the model another way."""
    try:
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": "Hi"}],
            tokenize=False,
            add_generation_prompt=True,
            chat_template=chat_template,
            tools=[_PROBE_TOOL],
        )
    except Exception:  # a template that fails on tools cannot render them
        return False
    return isinstance(rendered, str) and _PROBE_TOOL["function"]["name"] in rendered


def _is_tool_message(message: dict[str, Any]) -> bool:
    return message["role"] == "tool" or bool(message.get("tool_calls"))


def _render_error(messages: Conversation, chat_template: str | None, error: Exception) -> InvalidRequestError:
    """The template's failure, naming the first tool-shaped message (what templates most
    often cannot render) when there is one."""
    detail = f"{type(error).__name__}: {error}"
    index = next((i for i, message in enumerate(messages) if _is_tool_message(message)), None)
    if index is None:
        field = "chat_template" if chat_template is not None else "messages"
        return InvalidRequestError(field, f"the chat template could not render the messages: {detail}")
    return InvalidRequestError(
        f"messages[{index}]",
        f"the chat template could not render the messages; messages[{index}] (role {messages[index]['role']!r}) "
        f"is the first with tool calls or results, which this template may not support: {detail}",
    )


def _check_tool_messages_rendered(messages: Conversation, rendered: str, marker: str) -> None:
    """Every tool result's content and every tool call's function name is in the output: a
    template that knows no tools would drop them silently."""
    for i, message in enumerate(messages):
        if message["role"] == "tool" and f"{marker}{i}{marker}" not in rendered:
            raise _not_rendered(i, message, "tool results (role 'tool')")
        for call in message.get("tool_calls") or ():
            name = call.get("function", {}).get("name", "") if isinstance(call, dict) else ""
            if name not in rendered:
                raise _not_rendered(i, message, "assistant tool_calls")


def _not_rendered(index: int, message: dict[str, Any], what: str) -> InvalidRequestError:
    return InvalidRequestError(
        f"messages[{index}]",
        f"messages[{index}] (role {message['role']!r}) cannot be expressed by this model's chat template: "
        f"it does not render {what}",
    )


def _reserved_names(tokenizer: PreTrainedTokenizerBase) -> set[str]:
    """apply_chat_template's own parameters (and the conversation), which template variables must not shadow."""
    return set(inspect.signature(tokenizer.apply_chat_template).parameters) | {"messages"}
