"""Decoding images from what a request may send, within limits.

Accepted: a PIL image (offline API), raw bytes, a base64 `data:image/...` URL, and an http(s) URL
whose host is on the allowed list (none by default: remote fetches are refused), in the common
formats of IMAGE_FORMATS. The header is
read before any pixel is: an image over `max_pixels` (a decompression bomb) is refused without
being decoded, and so is an encoded file over `max_bytes`. Every failure is an
`InvalidRequestError` naming the field.
"""

from __future__ import annotations

import base64
import binascii
import io
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

from pagoda.errors import InvalidRequestError

# What an image may cost before it is refused: 20 MiB encoded, 40 megapixels decoded.
DEFAULT_MAX_IMAGE_BYTES = 20 * 2**20
DEFAULT_MAX_IMAGE_PIXELS = 40_000_000
REMOTE_FETCH_TIMEOUT_S = 10.0
# The formats decoded; Pillow's others (EPS runs Ghostscript, among them) are refused.
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")


@dataclass(frozen=True)
class MediaLimits:
    max_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    # Hosts an http(s) image URL may name (exact host names); empty: remote URLs are refused.
    allowed_domains: frozenset[str] = field(default_factory=frozenset)
    # Images one request may carry.
    max_images: int = 16


def load_image(source: Any, field_name: str, limits: MediaLimits) -> Any:
    """An RGB `PIL.Image` from `source`; InvalidRequestError naming `field_name` if it is not an
    image, is damaged, or is over a limit."""
    from PIL import Image

    if isinstance(source, Image.Image):
        _check_pixels(source.width, source.height, field_name, limits)
        return source.convert("RGB")
    if isinstance(source, str):
        source = _bytes_of_url(source, field_name, limits)
    if not isinstance(source, (bytes, bytearray, memoryview)):
        raise InvalidRequestError(field_name, f"{field_name} must be an image: a PIL image, bytes or a URL")
    if len(source) > limits.max_bytes:
        raise InvalidRequestError(
            field_name, f"{field_name} is {len(source)} bytes; images may be at most {limits.max_bytes} bytes"
        )
    return _decode(bytes(source), field_name, limits)


def _decode(data: bytes, field_name: str, limits: MediaLimits) -> Any:
    from PIL import Image

    try:
        # open() reads the header only: the size is known before any pixel is decoded.
        with Image.open(io.BytesIO(data), formats=IMAGE_FORMATS) as image:
            _check_pixels(image.width, image.height, field_name, limits)
            image.load()
            return image.convert("RGB")
    except InvalidRequestError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as error:
        raise InvalidRequestError(field_name, f"{field_name} is too large to decode: {error}") from error
    except Exception as error:  # any decoder failure is the file's fault
        raise InvalidRequestError(field_name, f"{field_name} is not a readable image: {error}") from error


def _check_pixels(width: int, height: int, field_name: str, limits: MediaLimits) -> None:
    if width < 1 or height < 1:
        raise InvalidRequestError(field_name, f"{field_name} has no pixels ({width}x{height})")
    if width * height > limits.max_pixels:
        raise InvalidRequestError(
            field_name,
            f"{field_name} is {width}x{height} = {width * height} pixels; images may have at most "
            f"{limits.max_pixels} pixels",
        )


def _bytes_of_url(url: str, field_name: str, limits: MediaLimits) -> bytes:
    if url.startswith("data:"):
        header, sep, payload = url.partition(",")
        if not sep or not header.endswith(";base64") or not header[5:].startswith("image/"):
            raise InvalidRequestError(field_name, f"{field_name} must be a data:image/...;base64, URL")
        if len(payload) > limits.max_bytes * 4 // 3 + 4:
            raise InvalidRequestError(field_name, f"{field_name} is over the limit of {limits.max_bytes} bytes")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as error:
            raise InvalidRequestError(field_name, f"{field_name} is not valid base64: {error}") from error
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https"):
        raise InvalidRequestError(field_name, f"{field_name} must be a data: URL or an http(s) URL")
    if parsed.hostname not in limits.allowed_domains:
        raise InvalidRequestError(
            field_name,
            f"{field_name}: fetching images from {parsed.hostname!r} is not allowed "
            "(the server's --allowed-media-domains lists the hosts it fetches from)",
        )
    return _fetch(url, field_name, limits)


def _fetch(url: str, field_name: str, limits: MediaLimits) -> bytes:
    """The body of `url`, read up to the byte limit (a longer one is refused, not truncated)."""
    import httpx

    try:
        with httpx.stream("GET", url, timeout=REMOTE_FETCH_TIMEOUT_S, follow_redirects=False) as response:
            if response.status_code != 200:
                raise InvalidRequestError(field_name, f"{field_name}: fetching it answered HTTP {response.status_code}")
            chunks, size = [], 0
            for chunk in response.iter_bytes():
                size += len(chunk)
                if size > limits.max_bytes:
                    raise InvalidRequestError(field_name, f"{field_name} is over the limit of {limits.max_bytes} bytes")
                chunks.append(chunk)
            return b"".join(chunks)
    except httpx.HTTPError as error:
        raise InvalidRequestError(field_name, f"{field_name} could not be fetched: {error}") from error
