"""`LoRARequestChecker`: the front end's check of a request's adapter, before it reaches the core.

An adapter is checked against the model once per id (config and safetensors header only); the
id is then bound to that adapter, since slots, the CPU cache and prefix-cache blocks are keyed
by it: another name or path under a known id is refused.
"""

from __future__ import annotations

from transformers import PretrainedConfig

from pagoda.config import LoRAConfig
from pagoda.errors import InvalidRequestError
from pagoda.lora.peft_loader import read_adapter
from pagoda.lora.request import LoRARequest


class LoRARequestChecker:
    def __init__(self, lora_config: LoRAConfig | None, hf_config: PretrainedConfig) -> None:
        self.lora_config = lora_config
        self.hf_config = hf_config
        self._checked: dict[int, LoRARequest] = {}

    def check(self, lora_request: object) -> None:
        if self.lora_config is None:
            raise InvalidRequestError("lora_request", "LoRA is not enabled: start the engine with enable_lora=True")
        if not isinstance(lora_request, LoRARequest):
            raise InvalidRequestError(
                "lora_request", f"lora_request must be a LoRARequest, got {type(lora_request).__name__}"
            )
        known = self._checked.get(lora_request.lora_int_id)
        if known == lora_request:
            return
        if known is not None:
            raise InvalidRequestError(
                "lora_request",
                f"lora_int_id {known.lora_int_id} already names adapter {known.lora_name!r} ({known.lora_path}); "
                f"give adapter {lora_request.lora_name!r} its own id",
            )
        read_adapter(lora_request, self.hf_config, self.lora_config.max_lora_rank, load_weights=False, dtype=None)
        self._checked[lora_request.lora_int_id] = lora_request

    def forget(self, lora_int_id: int) -> None:
        """Unbind an id (an unloaded adapter): it may name another adapter later."""
        self._checked.pop(lora_int_id, None)
