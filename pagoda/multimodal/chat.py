"""Images in chat messages: content parts (OpenAI's `image_url`, a PIL `image_pil`) become a
marker in the message's text, which `render_chat` turns into the model's image token after the
template ran, so an image sits where its part was; the images travel beside the prompt.

The markers hold a secret made per process, so no text a client sends can pass for one.
"""

from __future__ import annotations

import uuid
from typing import Any

from pagoda.errors import InvalidRequestError

# Where an image goes in a rendered message's text.
IMAGE_MARKER = f"\x00pagoda-image-{uuid.uuid4().hex}\x00"
# Around an image URL kept in a validated message's text (the server's protocol).
IMAGE_URL_MARKER = f"\x00pagoda-image-url-{uuid.uuid4().hex}\x00"


def content_parts_text(parts: list[Any], field: str) -> tuple[str, list[Any]]:
    """A content list as one text (parts one per line, each image a marker) and its images
    (URL strings or PIL images), for `LLM.chat`."""
    texts: list[str] = []
    images: list[Any] = []
    for i, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "image_url" and isinstance(part.get("image_url"), dict) and "url" in part["image_url"]:
            texts.append(IMAGE_MARKER)
            images.append(part["image_url"]["url"])
        elif kind in ("image", "image_pil") and kind in part:
            texts.append(IMAGE_MARKER)
            images.append(part[kind])
        else:
            raise InvalidRequestError(
                f"{field}[{i}]",
                f"{field}[{i}] must be {{'type': 'text', 'text': ...}}, {{'type': 'image_url', 'image_url': "
                "{'url': ...}} or {'type': 'image_pil', 'image_pil': <PIL image>}",
            )
    return "\n".join(texts), images


def split_content_images(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[Any]]:
    """`LLM.chat`'s messages with list contents made text, and the images in order."""
    flat: list[dict[str, Any]] = []
    images: list[Any] = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            text, found = content_parts_text(content, f"messages[{i}].content")
            message = {**message, "content": text}
            images += found
        flat.append(message)
    return flat, images


def take_image_urls(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[tuple[str, str]]]:
    """The server's validated messages with each kept URL made an image marker, and the
    (field, URL) of each image in order."""
    urls: list[tuple[str, str]] = []
    out = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if isinstance(content, str) and IMAGE_URL_MARKER in content:
            pieces = content.split(IMAGE_URL_MARKER)
            for j in range(1, len(pieces), 2):
                urls.append((f"messages[{i}].content", pieces[j]))
                pieces[j] = IMAGE_MARKER
            message = {**message, "content": "".join(pieces)}
        out.append(message)
    return out, urls


def text_length(content: str) -> int:
    """Characters of a validated content's text, its kept image URLs left out (they are no prompt text)."""
    if IMAGE_URL_MARKER not in content:
        return len(content)
    return sum(len(piece) for piece in content.split(IMAGE_URL_MARKER)[::2])
