"""What the state-space and hybrid causal LMs share: their layer stack under one HF prefix with
the LM head beside it (tied to the stack's embedding when the config says so), their weight
loading by HF name (no pipeline stages, so none of the dense decoder's stage bookkeeping), the
HF names they expect, and their refusal of model parallelism (Mamba-2 layers are not split
across ranks)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable

import torch
from torch import nn
from transformers import PretrainedConfig

from pagoda.attention.backends import AttentionBackend
from pagoda.config import ConfigError
from pagoda.distributed.parallel_state import get_parallel_state
from pagoda.forward_context import ForwardContext
from pagoda.model.layers.embedding import ParallelLMHead
from pagoda.model.layers.weight_utils import load_checkpoint_weight
from pagoda.model.models.decoder import StackedParams, checkpoint_names, is_derived_weight, stacked_param_name
from pagoda.outputs import IntermediateTensors


def check_single_rank(architecture: str) -> None:
    state = get_parallel_state()
    if state.tp_size > 1 or not (state.is_first_pp_rank and state.is_last_pp_rank):
        raise ConfigError(f"{architecture}: tensor_parallel_size and pipeline_parallel_size must be 1")


class StateSpaceLMBase(nn.Module, ABC):
    """Subclasses build their layer stack (`build_body`), held as `body_name` (its HF prefix);
    they may map checkpoint names to merged parameters in `stacked_params` ((ours, HF's, shard
    id) triples), and other spellings of names to theirs in `renamed`."""

    body_name: str = "model"
    stacked_params: StackedParams = ()
    renamed: tuple[tuple[str, str], ...] = ()

    def __init__(self, config: PretrainedConfig, attn_backend: type[AttentionBackend]) -> None:
        check_single_rank(type(self).__name__)
        super().__init__()
        self.config = config
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        body = self.build_body(config, attn_backend)
        self.add_module(self.body_name, body)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if self.tie_word_embeddings:
            self.lm_head.tie_to(body.get_input_embeddings())

    @classmethod
    @abstractmethod
    def build_body(cls, config: PretrainedConfig, attn_backend: type[AttentionBackend]) -> nn.Module:
        """The layer stack: (input_ids, positions, context) -> final hidden states, with
        `get_input_embeddings()` giving its token embedding."""

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        context: ForwardContext,
        intermediate_tensors: IntermediateTensors | None = None,
    ) -> torch.Tensor:
        return getattr(self, self.body_name)(input_ids, positions, context)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden states [N, hidden] -> float32 logits [N, vocab]."""
        return self.lm_head(hidden_states).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load (HF name, full tensor) pairs; returns the HF names loaded."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            if is_derived_weight(hf_name, self.tie_word_embeddings):
                continue
            canonical = self._canonical_name(hf_name)
            name, shard_id = stacked_param_name(canonical, self.stacked_params)
            if name not in params:
                raise ValueError(f"checkpoint weight {hf_name!r} has no parameter in {type(self).__name__}")
            load_checkpoint_weight(params[name], tensor, hf_name, shard_id)
            loaded.add(canonical)
        return loaded

    def _canonical_name(self, hf_name: str) -> str:
        for old, new in self.renamed:
            hf_name = hf_name.replace(old, new)
        return hf_name

    def expected_weight_names(self) -> set[str]:
        """The HF names `load_weights` must see for every parameter to be filled."""
        names = set()
        for name, _ in self.named_parameters():
            names.update(checkpoint_names(name, self.stacked_params))
        return names
