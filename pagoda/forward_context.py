"""`ForwardContext`: everything one forward pass reads besides token ids and positions.

The runner builds it each step and hands it to the model explicitly (no global, no growing
argument list); layers look themselves up by name. Per-step inputs of later features (a
LoRA index per token, multimodal embeddings, recurrent-state slots) belong here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from pagoda.attention.metadata import AttentionMetadata
    from pagoda.multimodal.inputs import MultiModalEmbeddings
    from pagoda.worker.kv_connector.base import KVConnector


@dataclass(frozen=True)
class ForwardContext:
    # Layer name -> the metadata of its KV-cache group for this step (shared within a group).
    attn_metadata: dict[str, AttentionMetadata]
    # Layer name -> its view of the KV cache (fixed once the cache is allocated).
    kv_caches: dict[str, torch.Tensor]
    # A layer-wise KV connector, in eager steps that carry its jobs: each attention layer waits
    # for its load before and hands it what it wrote after (None otherwise, and in graphs).
    kv_connector: KVConnector | None = None
    # Encoder outputs (images) to write over the token embeddings at their placeholders; None: none this step.
    mm_embeddings: MultiModalEmbeddings | None = None
