"""`LoRARequest`: which adapter a request runs with (vLLM's name and fields)."""

from __future__ import annotations

from dataclasses import dataclass

from pagoda.errors import InvalidRequestError


@dataclass(frozen=True)
class LoRARequest:
    """A PEFT adapter directory (`adapter_config.json` + `adapter_model.safetensors`).

    `lora_int_id` (>= 1) is the adapter's identity in the engine: slots, the CPU cache and the
    prefix cache are keyed by it, so one id must always name the same adapter files.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise InvalidRequestError("lora_request", "lora_request.lora_name must be a non-empty string")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise InvalidRequestError(
                "lora_request", f"lora_request.lora_int_id must be an integer >= 1, got {self.lora_int_id!r}"
            )
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise InvalidRequestError("lora_request", "lora_request.lora_path must be a non-empty string")

    # vLLM's aliases.
    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

    def cache_key(self) -> bytes:
        """What keys this adapter's prefix-cache blocks: id, name and path, length-prefixed."""
        parts = (str(self.lora_int_id), self.lora_name, self.lora_path)
        return b"".join(len(p.encode()).to_bytes(4, "little") + p.encode() for p in parts)
