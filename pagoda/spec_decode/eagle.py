"""`EagleProposer`: an EAGLE-1 or EAGLE-3 head drafts k tokens from the target's hidden states.

The head's KV lives in the engine's KV-cache groups as a draft model's does (see `draft_model`),
and its one-token steps are the draft model's, with the head's own hidden state carried from
step to step. What differs is the catch-up: an EAGLE head at position i reads the target's
hidden state there (EAGLE-1: the final one; EAGLE-3: the residual stream entering three layers,
captured during the target's forward, graphs included) beside the embedding of the token at
i + 1. So it runs after verification, over the step's own token layout (the target's positions,
slots and attention metadata) with the ids shifted by one: the next known token (the prompt's,
a draft's), or where that is the token just emitted, the emitted one (the model's sample after
the last accepted draft). Positions past a row's accepted drafts read rejected drafts; their KV
is rewritten by the next step's catch-up. The output at each sampling row's last accepted
position gives its first draft; k - 1 one-token steps give the others.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from pagoda.attention.layer import Attention
from pagoda.config import ConfigError, ModelConfig
from pagoda.model.models.decoder import DecoderModel
from pagoda.model.models.eagle import Eagle1Head, Eagle3Head, eagle3_aux_layers
from pagoda.sample.metadata import SamplingMetadata
from pagoda.spec_decode.draft_model import DRAFT_LAYER_PREFIX, DraftModelProposer, DraftSettings

if TYPE_CHECKING:
    from pagoda.forward_context import ForwardContext
    from pagoda.worker.gpu_model_runner import GPUModelRunner, PreparedInputs


class EagleProposer(DraftModelProposer):
    def __init__(self, runner: GPUModelRunner, head_config: ModelConfig, num_speculative_tokens: int, method: str):
        super().__init__(runner, head_config, num_speculative_tokens)
        self.method = method
        hidden_size = head_config.hf_config.hidden_size
        self.hidden = torch.zeros(runner.max_num_reqs, hidden_size, dtype=runner.dtype, device=runner.device)
        self.shifted_ids = runner.buffer(runner.max_num_tokens, torch.int64)
        self.emitted_rows = runner.buffer(runner.max_num_tokens, torch.int64)
        self.emitted_columns = runner.buffer(runner.max_num_tokens, torch.int64)
        self.aux_hidden_states: torch.Tensor | None = None

    def load_model(self) -> torch.nn.Module:
        from pagoda.model.loader.dummy import init_dummy_weights
        from pagoda.model.loader.model_loader import _default_dtype, check_weights_complete
        from pagoda.model.loader.safetensors_loader import iter_safetensors_weights

        runner = self.runner
        config = self.draft_config
        head_class = Eagle3Head if self.method == "eagle3" else Eagle1Head
        dummy = config.load_format == "dummy"
        names = set() if dummy else {name for name, _ in iter_safetensors_weights(config.model)}
        config.hf_config.eagle_fc_bias = "fc.bias" in names
        with _default_dtype(config.dtype), torch.device(runner.device):
            head = head_class(config.hf_config, runner.attn_backend)
            if isinstance(head, Eagle3Head) and "embed_tokens.weight" in names:
                head.with_own_embedding()
        with torch.no_grad():
            if dummy:
                init_dummy_weights(head, config.seed)
            else:
                check_weights_complete(head, head.load_weights(iter_safetensors_weights(config.model)), config.model)
        head.share_target(runner.model)
        if isinstance(head, Eagle3Head):
            target = runner.model.model
            if not isinstance(target, DecoderModel):
                raise ConfigError(
                    f"speculative_config.method 'eagle3' needs a Llama-style target, not {type(runner.model).__name__}"
                )
            layers = getattr(config.hf_config, "eagle_aux_hidden_state_layer_ids", None)
            target.aux_hidden_state_layers = tuple(layers or eagle3_aux_layers(runner.model_config.num_layers))
            width = len(target.aux_hidden_state_layers) * runner.model_config.hf_config.hidden_size
            self.aux_hidden_states = torch.zeros(runner.max_num_tokens, width, dtype=runner.dtype, device=runner.device)
            target.aux_hidden_states = self.aux_hidden_states
        self.model = head.requires_grad_(False).eval()
        self.layers = [module for module in head.modules() if isinstance(module, Attention)]
        for layer in self.layers:
            layer.layer_name = DRAFT_LAYER_PREFIX + layer.layer_name
        return self.model

    def catch_up(self, input_ids: torch.Tensor, positions: torch.Tensor, context: ForwardContext) -> None:
        """Nothing during the target's forward: the head's catch-up needs the step's new tokens."""

    def propose(
        self,
        inputs: PreparedInputs,
        hidden_states: torch.Tensor,
        token_ids: torch.Tensor | None,
        metadata: SamplingMetadata | None,
    ) -> torch.Tensor | None:
        assert self.model is not None
        self.begin_staging()  # _shifted_ids writes pinned buffers too
        num_tokens = inputs.input_ids.shape[0]
        target_hidden = hidden_states if self.aux_hidden_states is None else self.aux_hidden_states[:num_tokens]
        out, carried = self.model(
            self._shifted_ids(inputs, token_ids),
            inputs.positions,
            self.model.combine_hidden_states(target_hidden),
            inputs.forward_context,
        )
        if token_ids is None:
            self.end_staging()
            return None
        assert metadata is not None
        num_emitted = (token_ids >= 0).sum(dim=1)
        num_rows = len(num_emitted)
        # The step's token index of each row's last emitted token.
        index = self.runner.logits_indices.gpu[self.last_logits_rows(inputs, num_emitted)]
        settings = DraftSettings.of(self, inputs, num_emitted, metadata)
        drafts = torch.empty((num_rows, self.num_speculative_tokens), dtype=torch.int64, device=token_ids.device)
        drafts[:, 0] = settings.draw(self.model.compute_logits(out.index_select(0, index)), 0)
        self.input_ids[:num_rows] = drafts[:, 0]
        self.hidden[:num_rows] = carried.index_select(0, index)
        self._draft_steps(inputs, num_emitted, settings, drafts, 1)
        self.end_staging()
        return drafts

    def _step_forward(self, num_rows: int, context: ForwardContext) -> torch.Tensor:
        assert self.model is not None
        out, carried = self.model(self.input_ids[:num_rows], self.positions[:num_rows], self.hidden[:num_rows], context)
        self.hidden[:num_rows].copy_(carried)
        return out

    def _shifted_ids(self, inputs: PreparedInputs, token_ids: torch.Tensor | None) -> torch.Tensor:
        """[tokens] the id after each of the step's tokens: the known next token from the host,
        or the token this step emitted there (written on the device)."""
        runner = self.runner
        batch = runner.input_batch
        num_reqs, total = batch.num_reqs, inputs.num_scheduled_tokens
        num_tokens = inputs.input_ids.shape[0]
        starts = runner.query_start_loc.np[: num_reqs + 1].astype(np.int64)
        rows = np.repeat(np.arange(num_reqs), np.diff(starts))
        following = runner.positions.np[:total] + 1
        known = following < (batch.num_tokens[rows] + batch.num_spec_tokens[rows])
        ids = batch.token_ids_cpu[rows, np.minimum(following, runner.max_model_len - 1)]
        self.shifted_ids.np[:total] = np.where(known, ids, 0)
        self.shifted_ids.np[total:num_tokens] = 0
        shifted = self.shifted_ids.copy_to_gpu(num_tokens)
        if token_ids is None:
            return shifted
        # Each logits row's token (-1 past a row's last emitted one) goes after its position.
        num_logits = int((inputs.num_drafts + 1).sum())
        self.emitted_rows.np[:num_logits] = np.repeat(np.arange(len(inputs.sample_rows)), inputs.num_drafts + 1)
        self.emitted_columns.np[:num_logits] = np.arange(num_logits) - np.repeat(
            inputs.logits_start, inputs.num_drafts + 1
        )
        emitted = token_ids[self.emitted_rows.copy_to_gpu(num_logits), self.emitted_columns.copy_to_gpu(num_logits)]
        where = inputs.logits_indices
        shifted[where] = torch.where(emitted >= 0, emitted, shifted[where])
        return shifted
