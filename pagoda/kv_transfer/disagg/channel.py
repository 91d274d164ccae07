"""The control channel between a consumer and a producer: JSON objects over one ZMQ REQ/ROUTER pair.

A consumer's worker sends, on a fresh REQ socket per transfer:
  {"kind": "pull", "request_id", "token", "block_ids"}  ->  {"ok": true, "segment", "num_blocks", "block_bytes"}
  {"kind": "ack", "request_id", "token"}                 ->  {"ok": true}
A refusal is {"ok": false, "error": "..."}. JSON, not pickle: whoever can reach the socket may
send anything, and decoding it must not run code. The one-time token from the producer's answer
(`kv_transfer_params.remote_token`) is what lets a consumer read a request's blocks.
"""

from __future__ import annotations

import json
from typing import Any

import zmq

PULL = "pull"
ACK = "ack"


class ChannelError(RuntimeError):
    """The peer refused, answered garbage or did not answer in time."""


def encode(message: dict[str, Any]) -> bytes:
    return json.dumps(message, separators=(",", ":")).encode()


def decode(payload: bytes) -> dict[str, Any]:
    try:
        message = json.loads(payload)
    except ValueError as error:
        raise ChannelError(f"not a JSON message: {error}") from error
    if not isinstance(message, dict):
        raise ChannelError(f"a message must be a JSON object, got {type(message).__name__}")
    return message


class ControlClient:
    """A consumer's REQ socket to one producer, for one transfer (a REQ socket that timed out is
    stuck, so each transfer opens its own)."""

    def __init__(self, context: zmq.Context, address: str) -> None:
        self.address = address
        self._socket = context.socket(zmq.REQ)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(address)

    def call(self, message: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """Send `message` and return the producer's answer; ChannelError on a refusal or no answer."""
        self._socket.send(encode(message))
        if not self._socket.poll(int(timeout_s * 1000)):
            raise ChannelError(f"no answer from the producer at {self.address} within {timeout_s:g} s")
        reply = decode(self._socket.recv())
        if reply.get("ok") is not True:
            raise ChannelError(f"the producer at {self.address} refused: {reply.get('error', reply)}")
        return reply

    def close(self) -> None:
        self._socket.close()
