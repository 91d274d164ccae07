"""Chat-template rendering that keeps user text as text.

The model's template is rendered with each message's content replaced by a placeholder;
the template's own pieces are tokenized normally (its special tokens become control
tokens), the users' pieces with special-token matching off. So `<|im_start|>` typed by a
user stays plain text and can never forge a role. transformers renders templates in an
`ImmutableSandboxedEnvironment`: a template cannot reach Python internals (`__class__`,
`__globals__`, ...) or mutate what it is given; any failure to render is the input's fault
and is reported as an InvalidRequestError.
"""

from __future__ import annotations

import inspect
import re
import uuid
from typing import Any

from transformers import PreTrainedTokenizerBase

from pagoda.errors import InvalidRequestError

Conversation = list[dict[str, Any]]


def render_chat(
    tokenizer: PreTrainedTokenizerBase,
    messages: Conversation,
    add_generation_prompt: bool = True,
    chat_template: str | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """`template_kwargs` are extra template variables; `chat_template` replaces the model's."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages", "messages must be a non-empty list of {'role', 'content'} dicts")
    if chat_template is None and tokenizer.chat_template is None:
        raise InvalidRequestError("messages", "this model has no chat template; send a plain prompt instead")
    marker = f"\x00PAGODA{uuid.uuid4().hex}"
    contents: list[str] = []
    placeholder_messages = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message or not isinstance(message.get("content"), str):
            raise InvalidRequestError(
                f"messages[{i}]", f"messages[{i}] must be a dict with string 'role' and 'content'"
            )
        placeholder_messages.append({**message, "content": f"{marker}{len(contents)}{marker}"})
        contents.append(message["content"])
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
            **template_kwargs,
        )
    except Exception as error:  # the template and its variables are input; a failure says what broke
        field = "chat_template" if chat_template is not None else "messages"
        raise InvalidRequestError(
            field, f"the chat template could not render the messages: {type(error).__name__}: {error}"
        ) from error
    if not isinstance(rendered, str):
        raise InvalidRequestError("chat_template", "the chat template must render to one string")
    token_ids: list[int] = []
    for i, piece in enumerate(re.split(re.escape(marker) + r"(\d+)" + re.escape(marker), rendered)):
        if not piece:
            continue
        if i % 2 == 0:
            token_ids += tokenizer.encode(piece, add_special_tokens=False)
        else:
            token_ids += tokenizer.encode(contents[int(piece)], add_special_tokens=False, split_special_tokens=True)
    return token_ids


def _reserved_names(tokenizer: PreTrainedTokenizerBase) -> set[str]:
    """apply_chat_template's own parameters (and the conversation), which template variables must not shadow."""
    return set(inspect.signature(tokenizer.apply_chat_template).parameters) | {"messages"}
