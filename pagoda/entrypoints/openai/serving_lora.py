"""LoRA adapters served under their own model names.

`--lora-modules name=path ...` registers adapters at start; a request's `model` then picks one
(the base model's name picks none); `/v1/models` lists them with the base model as `parent`.
With `--enable-lora-updates`, `POST /v1/load_lora_adapter` `{"lora_name", "lora_path"}` checks
an adapter against the model and registers it, `POST /v1/unload_lora_adapter` `{"lora_name"}`
forgets it (403 without the flag: loading reads any path the server can). Each adapter gets an
id of its own, never reused, so an adapter loaded again under an old name is a new adapter to the
slots and the prefix cache.
"""

from __future__ import annotations

import itertools

from pydantic import Field

from pagoda.engine.async_llm import AsyncLLM
from pagoda.entrypoints.openai.errors import OpenAIError, invalid_request
from pagoda.entrypoints.openai.protocol import ModelCard, RequestBody, Text
from pagoda.errors import InvalidRequestError
from pagoda.lora.request import LoRARequest


class LoadLoRAAdapterRequest(RequestBody):
    lora_name: Text = Field(min_length=1, description="the model name requests will use for the adapter")
    lora_path: Text = Field(min_length=1, description="the PEFT adapter directory the server reads")


class UnloadLoRAAdapterRequest(RequestBody):
    lora_name: Text = Field(min_length=1)


class OpenAIServingLoRA:
    def __init__(self, engine: AsyncLLM, served_model_name: str) -> None:
        self.engine = engine
        self.served_model_name = served_model_name
        self.adapters: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)

    def lora_request(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names (None: the base model, or no model given)."""
        return self.adapters.get(model) if model is not None else None

    def knows(self, model: str) -> bool:
        return model == self.served_model_name or model in self.adapters

    def model_cards(self, max_model_len: int) -> list[ModelCard]:
        base = ModelCard(id=self.served_model_name, max_model_len=max_model_len)
        return [base] + [
            ModelCard(id=name, max_model_len=max_model_len, parent=self.served_model_name, root=lora.lora_path)
            for name, lora in self.adapters.items()
        ]

    def register(self, name: str, path: str) -> LoRARequest:
        """Check the adapter against the model and serve it as `name` (at start: --lora-modules)."""
        lora = self._new_adapter(name, path)
        self._check(lora)
        self.adapters[name] = lora
        return lora

    async def load(self, name: str, path: str) -> LoRARequest:
        """`register`, with the check (file reads) on the processing thread."""
        lora = self._new_adapter(name, path)
        await self.engine.run_processing(lambda: self._check(lora))
        if self.knows(name):  # loaded meanwhile under the same name
            raise OpenAIError(400, f"lora_name {name!r} is already a served model name", param="lora_name")
        self.adapters[name] = lora
        return lora

    def _new_adapter(self, name: str, path: str) -> LoRARequest:
        if self.knows(name):
            raise OpenAIError(400, f"lora_name {name!r} is already a served model name", param="lora_name")
        return LoRARequest(name, next(self._ids), path)

    def _check(self, lora: LoRARequest) -> None:
        try:
            self.engine.engine.processor.lora_checker.check(lora)
        except InvalidRequestError as error:
            raise invalid_request(error, {"lora_request": "lora_path"}) from error

    def unload(self, name: str) -> LoRARequest:
        lora = self.adapters.pop(name, None)
        if lora is None:
            raise OpenAIError(404, f"no LoRA adapter is served as {name!r}", param="lora_name", code="model_not_found")
        self.engine.engine.processor.lora_checker.forget(lora.lora_int_id)
        return lora
