"""What the state-space and hybrid causal LMs share: their weight loading by HF name (tied
embeddings, no merged projections), the HF names they expect, and their refusal of model
parallelism (Mamba-2 layers are not split across ranks)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pagoda.config import ConfigError
from pagoda.distributed.parallel_state import get_parallel_state
from pagoda.model.layers.weight_utils import default_weight_loader


def check_single_rank(architecture: str) -> None:
    state = get_parallel_state()
    if state.tp_size > 1 or not (state.is_first_pp_rank and state.is_last_pp_rank):
        raise ConfigError(f"{architecture}: tensor_parallel_size and pipeline_parallel_size must be 1")


class StateSpaceLMBase(nn.Module):
    """Subclasses may map checkpoint names to merged parameters in `stacked_params` ((ours,
    HF's, shard id) triples), and other spellings of names to theirs in `renamed`."""

    stacked_params: tuple[tuple[str, str, int | str], ...] = ()
    renamed: tuple[tuple[str, str], ...] = ()

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden states [N, hidden] -> float32 logits [N, vocab]."""
        return self.lm_head(hidden_states).float()

    def _param_name(self, hf_name: str) -> tuple[str, int | str | None]:
        for old, new in self.renamed:
            hf_name = hf_name.replace(old, new)
        for ours, hf, shard_id in self.stacked_params:
            if f".{hf}." in hf_name:
                return hf_name.replace(f".{hf}.", f".{ours}."), shard_id
        return hf_name, None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load (HF name, full tensor) pairs; returns the HF names loaded."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            if hf_name.endswith("rotary_emb.inv_freq") or (self.tie_word_embeddings and hf_name == "lm_head.weight"):
                continue
            name, shard_id = self._param_name(hf_name)
            if name not in params:
                raise ValueError(f"checkpoint weight {hf_name!r} has no parameter in {type(self).__name__}")
            param = params[name]
            loader = getattr(param, "weight_loader", default_weight_loader)
            try:
                loader(param, tensor, shard_id) if shard_id is not None else loader(param, tensor)
            except ValueError as e:
                raise ValueError(f"checkpoint weight {hf_name!r}: {e}") from e
            loaded.add(self._canonical_name(hf_name))
        return loaded

    def _canonical_name(self, hf_name: str) -> str:
        for old, new in self.renamed:
            hf_name = hf_name.replace(old, new)
        return hf_name

    def expected_weight_names(self) -> set[str]:
        """The HF names `load_weights` must see for every parameter to be filled."""
        names = set()
        for name, _ in self.named_parameters():
            merged = [
                name.replace(f".{ours}.", f".{hf}.") for ours, hf, _ in self.stacked_params if f".{ours}." in name
            ]
            names.update(merged or [name])
        return names
