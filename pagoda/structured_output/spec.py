"""`GrammarSpec`: what a request asks its output to follow, as the text a grammar compiles from."""

from __future__ import annotations

import json
from dataclasses import dataclass

from pagoda.sampling_params import StructuredOutputsParams


@dataclass(frozen=True)
class GrammarSpec:
    """One constraint: `kind` is the StructuredOutputsParams field set, `text` its value as text
    (JSON text for a schema or a choice, "" for json_object). Hashable: the compile cache's key."""

    kind: str
    text: str

    @property
    def field(self) -> str:
        """The request field an error about this constraint names."""
        return f"structured_outputs.{self.kind}"

    @classmethod
    def of(cls, params: StructuredOutputsParams) -> GrammarSpec:
        kind = params.kind
        value = getattr(params, kind)
        if kind == "json_object":
            return cls(kind, "")
        if kind == "choice" or (kind == "json" and not isinstance(value, str)):
            # Key order is kept: a schema's property order is the order the output writes them in.
            return cls(kind, json.dumps(value, ensure_ascii=False))
        return cls(kind, value)
