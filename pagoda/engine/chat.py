"""Chat-template rendering that keeps user text as text.

The model's template is rendered with each message's content replaced by a placeholder;
the template's own pieces are tokenized normally (its special tokens become control
tokens), the users' pieces with special-token matching off. So `<|im_start|>` typed by a
user stays plain text and can never forge a role. transformers renders templates in a
sandboxed Jinja environment.
"""

from __future__ import annotations

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
) -> list[int]:
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
    rendered = tokenizer.apply_chat_template(
        placeholder_messages, tokenize=False, add_generation_prompt=add_generation_prompt, chat_template=chat_template
    )
    token_ids: list[int] = []
    for i, piece in enumerate(re.split(re.escape(marker) + r"(\d+)" + re.escape(marker), rendered)):
        if not piece:
            continue
        if i % 2 == 0:
            token_ids += tokenizer.encode(piece, add_special_tokens=False)
        else:
            token_ids += tokenizer.encode(contents[int(piece)], add_special_tokens=False, split_special_tokens=True)
    return token_ids
