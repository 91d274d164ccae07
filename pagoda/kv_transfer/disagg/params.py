"""`kv_transfer_params`: what a request tells a producer or a consumer, and what a producer answers.

The router asks a producer to prefill with `{"do_remote_decode": true}`. The producer's answer
carries `RemotePrefill.to_params()`: where its control socket is, the request (export) id and
its one-time token, the held block ids and their prefix-cache hashes, the block size and the
token count they cover. The consumer is sent those params back unchanged; it pulls the leading
blocks whose hashes equal its own request's (the hashes chain over every token before them, so
a different prompt, salt or adapter matches nothing and is recomputed).

Plain data and no dependencies: the engine's processor checks a request's params with
`parse_kv_transfer_params`, which names the offending field.
"""

from __future__ import annotations

import os
import re
import tempfile
import uuid
from dataclasses import dataclass
from typing import Any

from pagoda.errors import InvalidRequestError

FIELD = "kv_transfer_params"
_HASH_HEX = re.compile(r"[0-9a-f]{64}")
_ADDRESS = re.compile(r"(ipc://\S+|tcp://[\w.\-\[\]:]+:\d+)")


def private_ipc_address() -> str:
    """A fresh ipc address for a producer's control socket: a path only this user can reach."""
    return f"ipc://{tempfile.gettempdir()}/pagoda-kv-{os.getuid()}-{uuid.uuid4().hex}"


@dataclass(frozen=True)
class RemoteDecode:
    """Asks a producer to hold the request's KV blocks, once prefilled, for a consumer's pull."""


@dataclass(frozen=True)
class RemotePrefill:
    """A producer's held blocks of one request, for a consumer to pull."""

    remote_address: str
    remote_request_id: str
    remote_token: str
    remote_block_ids: tuple[int, ...]
    remote_block_hashes: tuple[bytes, ...]
    block_size: int

    @property
    def num_tokens(self) -> int:
        return len(self.remote_block_ids) * self.block_size

    def to_params(self) -> dict[str, Any]:
        return {
            "do_remote_prefill": True,
            "remote_address": self.remote_address,
            "remote_request_id": self.remote_request_id,
            "remote_token": self.remote_token,
            "remote_block_ids": list(self.remote_block_ids),
            "remote_block_hashes": [h.hex() for h in self.remote_block_hashes],
            "block_size": self.block_size,
            "num_tokens": self.num_tokens,
        }


# The keys of `RemotePrefill.to_params()`.
_PREFILL_FIELDS = frozenset(
    {
        "do_remote_prefill",
        "remote_address",
        "remote_request_id",
        "remote_token",
        "remote_block_ids",
        "remote_block_hashes",
        "block_size",
        "num_tokens",
    }
)


def _error(name: str, message: str) -> InvalidRequestError:
    path = f"{FIELD}.{name}" if name else FIELD
    return InvalidRequestError(path, f"{path} {message}")


def _text(params: dict[str, Any], name: str, pattern: re.Pattern[str] | None = None) -> str:
    value = params.get(name)
    if not isinstance(value, str) or not value or len(value) > 1024:
        raise _error(name, f"must be a non-empty string of at most 1024 characters, got {value!r:.80}")
    if pattern is not None and not pattern.fullmatch(value):
        raise _error(name, f"must match {pattern.pattern}, got {value!r:.80}")
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_kv_transfer_params(params: Any) -> RemoteDecode | RemotePrefill | None:
    """The checked meaning of a request's `kv_transfer_params` (None when it has none)."""
    if params is None:
        return None
    if not isinstance(params, dict):
        raise _error("", f"must be an object, got {type(params).__name__}")
    if params.get("do_remote_decode") is True:
        extra = sorted(set(params) - {"do_remote_decode"})
        if extra:
            raise _error(extra[0], "is not taken with do_remote_decode (the producer's answer carries it)")
        return RemoteDecode()
    if params.get("do_remote_prefill") is not True:
        raise _error("", "must set do_remote_decode (to a producer) or do_remote_prefill (to a consumer) to true")
    extra = sorted(set(params) - _PREFILL_FIELDS)
    if extra:
        raise _error(extra[0], f"is not a known field (known: {', '.join(sorted(_PREFILL_FIELDS))})")
    block_size = params.get("block_size")
    if not _is_int(block_size) or block_size < 1 or block_size & (block_size - 1):
        raise _error("block_size", f"must be a power of two >= 1, got {block_size!r:.80}")
    block_ids = params.get("remote_block_ids")
    if not isinstance(block_ids, list) or not all(_is_int(b) and 0 <= b < 2**31 for b in block_ids):
        raise _error("remote_block_ids", f"must be a list of integers in [0, 2**31), got {block_ids!r:.80}")
    hashes = params.get("remote_block_hashes")
    if not isinstance(hashes, list) or not all(isinstance(h, str) and _HASH_HEX.fullmatch(h) for h in hashes):
        raise _error("remote_block_hashes", "must be a list of 64-digit lowercase hex sha256 hashes")
    if len(hashes) != len(block_ids):
        raise _error("remote_block_hashes", f"must have one hash per block id ({len(block_ids)}), got {len(hashes)}")
    num_tokens = params.get("num_tokens")
    if num_tokens != len(block_ids) * block_size or not _is_int(num_tokens):
        raise _error(
            "num_tokens",
            f"must be len(remote_block_ids) x block_size = {len(block_ids) * block_size}, got {num_tokens!r}",
        )
    return RemotePrefill(
        remote_address=_text(params, "remote_address", _ADDRESS),
        remote_request_id=_text(params, "remote_request_id"),
        remote_token=_text(params, "remote_token", re.compile(r"[0-9a-f]{32}")),
        remote_block_ids=tuple(block_ids),
        remote_block_hashes=tuple(bytes.fromhex(h) for h in hashes),
        block_size=block_size,
    )
