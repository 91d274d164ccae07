"""The model runner's pooling step: what `GPUModelRunner.execute_model` returns for a pooling
model instead of sampling (a request pools in the step that completes its prompt)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from pagoda.config import ModelConfig
from pagoda.outputs import ModelRunnerOutput
from pagoda.pooling.pooler import Pooler

if TYPE_CHECKING:
    from pagoda.worker.input_batch import CachedRequestState, InputBatch


def make_pooler(model_config: ModelConfig) -> Pooler | None:
    """The pooler of an embedding model; None for a model that samples."""
    if not model_config.is_embedding_model:
        return None
    assert model_config.pooler_config is not None
    return Pooler(model_config.pooler_config)


def pooling_output(
    pooler: Pooler,
    hidden_states: torch.Tensor,
    batch: InputBatch,
    requests: dict[str, CachedRequestState],
    query_start_loc: np.ndarray,
    rows: np.ndarray,
    whole_prompt: bool,
) -> ModelRunnerOutput:
    """The step's output: a vector for each of `rows` (the batch rows whose prompt completes), read
    from its tokens in this step (`query_start_loc`: each row's first flat token, then the total).
    With `whole_prompt` every such row must have computed its whole prompt in this step."""
    req_ids = list(batch.req_ids)
    output = ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={req_id: row for row, req_id in enumerate(req_ids)},
        sampled_token_ids=[[] for _ in req_ids],
    )
    if len(rows) == 0:
        return output
    if whole_prompt:
        partial = rows[batch.num_computed_tokens[rows] > 0]
        assert not len(partial), f"requests {[req_ids[r] for r in partial]} pool over a prompt computed in parts"
    starts = query_start_loc[rows].astype(np.int64)
    ends = query_start_loc[rows + 1].astype(np.int64)
    params = [requests[req_ids[row]].pooling_params for row in rows.tolist()]
    assert all(p is not None for p in params), "a pooling model runs pooling requests only"
    vectors = pooler.finish(
        pooler.pool(hidden_states, starts, ends), [p.dimensions for p in params], [p.normalize for p in params]
    )
    output.pooler_output = {req_ids[row]: vector for row, vector in zip(rows.tolist(), vectors, strict=True)}
    return output
