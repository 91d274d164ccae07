"""`EncoderRunner`: the model runner's multimodal half (the seed's encoder runner).

It keeps each request's images from its arrival until it ends, runs a step's scheduled encoder
inputs in one batch (`_extract_mm_kwargs`), each image's output cached by its content hash so
that the same image is encoded once across requests (`EncoderCache`), and gathers the rows of
the outputs that the step's prompt chunks place (`gather`). For an M-RoPE model it shifts the
step's rotary positions of requests with images and gives their image tokens' three positions.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from pagoda.config import SchedulerConfig
from pagoda.multimodal.encoder_cache import EncoderCache
from pagoda.multimodal.encoder_cuda_graph import DEFAULT_ENCODER_GRAPH_SIZES, EncoderCudaGraphManager
from pagoda.multimodal.inputs import MultiModalEmbeddings, MultiModalFeatureSpec
from pagoda.multimodal.mrope import MRopeLayout, mrope_layout
from pagoda.scheduler.output import SchedulerOutput


class EncoderRunner:
    def __init__(self, model: nn.Module, cache: EncoderCache, device: torch.device, encoder_budget: int) -> None:
        self.model = model
        self.encoder_budget = encoder_budget
        self.cache = cache
        self.device = device
        self.features: dict[str, tuple[MultiModalFeatureSpec, ...]] = {}
        self.num_encoded_images = 0
        # Benchmarks: with `timed`, the device is synchronized around each encoder run and its
        # seconds are added to `encoder_seconds` (off by default: it stalls the step).
        self.timed = False
        self.encoder_seconds = 0.0
        # Set by `make_cuda_graphs` for encoders of one input shape on CUDA (captured by the model runner).
        self.cuda_graphs: EncoderCudaGraphManager | None = None
        # M-RoPE models: each request's image layout (its positions' shifts), by request.
        self.spatial_merge_size: int | None = getattr(model, "mrope_spatial_merge_size", None)
        self.mrope_layouts: dict[str, MRopeLayout] = {}

    def update(self, scheduler_output: SchedulerOutput) -> None:
        """Apply the step's diff: ended requests drop their images, preempted ones release their
        cache entries (they resume with their encoder inputs scheduled again), new ones bring theirs."""
        for req_id in scheduler_output.finished_req_ids:
            self.features.pop(req_id, None)
            self.mrope_layouts.pop(req_id, None)
            self.cache.release(req_id)
        for req_id in scheduler_output.preempted_req_ids:
            self.cache.release(req_id)
        for new_req in scheduler_output.scheduled_new_reqs:
            if new_req.mm_features:
                self.features[new_req.req_id] = tuple(new_req.mm_features)
                if self.spatial_merge_size is not None:
                    self.mrope_layouts[new_req.req_id] = mrope_layout(new_req.mm_features, self.spatial_merge_size)

    def step_has_embeddings(self, num_scheduled: Mapping[str, int], requests: Mapping[str, Any]) -> bool:
        """Whether any scheduled chunk covers image placeholders (the step then runs eagerly);
        `requests`: the runner's request states, with each one's computed count before the step."""
        for req_id, features in self.features.items():
            count = num_scheduled.get(req_id)
            if count:
                start = requests[req_id].num_computed_tokens
                if any(f.mm_position.overlaps(start, start + count) for f in features):
                    return True
        return False

    def execute(self, scheduler_output: SchedulerOutput) -> None:
        """Encode the step's scheduled images that the cache lacks, each distinct image once."""
        pending: dict[str, tuple[MultiModalFeatureSpec, list[str]]] = {}
        for req_id, indices in scheduler_output.scheduled_encoder_inputs.items():
            features = self.features[req_id]
            for index in indices:
                feature = features[index]
                if feature.identifier in pending:
                    pending[feature.identifier][1].append(req_id)
                elif not self.cache.acquire(feature.identifier, req_id):
                    pending[feature.identifier] = (feature, [req_id])
        if not pending:
            return
        started = self._clock() if self.timed else 0.0
        outputs = self._encode(self._extract_mm_kwargs([feature for feature, _ in pending.values()]))
        if self.timed:
            self.encoder_seconds += self._clock() - started
        self.num_encoded_images += len(pending)
        for (identifier, (_, req_ids)), output in zip(pending.items(), outputs, strict=True):
            first, *others = req_ids
            self.cache.put(identifier, output.clone(), first)
            for req_id in others:
                self.cache.acquire(identifier, req_id)

    def _encode(self, items: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Each image's encoder output: a captured graph's replay where one fits, else eager."""
        if self.cuda_graphs is not None and self.cuda_graphs.captured:
            output = self.cuda_graphs.run(torch.stack([item["pixel_values"] for item in items]))
            if output is not None:
                return list(output)
        return self.model.embed_multimodal(items)

    def make_cuda_graphs(self) -> None:
        """Graphs for 1, 2, 4 and 8 images (those within a step's encoder budget), when every image
        has one input shape (the model's `encoder_graph_input_shape`); captured later."""
        shape = getattr(self.model, "encoder_graph_input_shape", None)
        if shape is None:
            return
        most = max(1, self.encoder_budget // self.model.max_tokens_per_image)
        sizes = [size for size in DEFAULT_ENCODER_GRAPH_SIZES if size <= most]
        dtype = next(self.model.parameters()).dtype
        self.cuda_graphs = EncoderCudaGraphManager(self.model.encode_images, shape, dtype, self.device, sizes)

    def _clock(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _extract_mm_kwargs(self, features: Sequence[MultiModalFeatureSpec]) -> list[dict[str, torch.Tensor]]:
        """The encoder's inputs, one dict per image, on the device (the model batches them)."""
        return [
            {name: tensor.to(self.device, non_blocking=True) for name, tensor in feature.data.items()}
            for feature in features
        ]

    def gather(
        self,
        req_ids: Sequence[str],
        num_computed: np.ndarray,
        num_scheduled: np.ndarray,
        query_start: np.ndarray,
    ) -> MultiModalEmbeddings | None:
        """The encoder output rows of the step's chunks and the flat token each replaces; rows
        are batch rows (`query_start[row]`: the row's first flat token)."""
        embeddings: list[torch.Tensor] = []
        token_index: list[np.ndarray] = []
        positions: list[np.ndarray] = []
        for row, req_id in enumerate(req_ids):
            features = self.features.get(req_id)
            if not features:
                continue
            start = int(num_computed[row])
            end = start + int(num_scheduled[row])
            layout = self.mrope_layouts.get(req_id)
            for image, feature in enumerate(features):
                position = feature.mm_position
                low, high = max(start, position.offset), min(end, position.end)
                if low >= high:
                    continue
                output = self.cache.get(feature.identifier)
                embeddings.append(output[low - position.offset : high - position.offset])
                token_index.append(np.arange(low, high, dtype=np.int64) - start + int(query_start[row]))
                if layout is not None:
                    positions.append(layout.image_positions(image, low - position.offset, high - position.offset))
        if not embeddings:
            return None
        index = torch.from_numpy(np.concatenate(token_index)).to(self.device, non_blocking=True)
        mrope = None
        if positions:
            mrope = torch.from_numpy(np.concatenate(positions, axis=1)).to(self.device, non_blocking=True)
        return MultiModalEmbeddings(torch.cat(embeddings), index, mrope)

    def shift_positions(
        self, req_ids: Sequence[str], first_token: np.ndarray, num_scheduled: np.ndarray, positions: np.ndarray
    ) -> None:
        """M-RoPE: the rotary positions (flat `positions`, written with the token indices) of the
        rows with images, shifted in place past their images (see pagoda/multimodal/mrope.py)."""
        if not self.mrope_layouts:
            return
        for row, req_id in enumerate(req_ids):
            layout = self.mrope_layouts.get(req_id)
            if layout is not None:
                tokens = slice(int(first_token[row]), int(first_token[row] + num_scheduled[row]))
                positions[tokens] = layout.text_positions(positions[tokens])

    def check_idle(self) -> None:
        """Raise AssertionError while any request's images or cache holds are left."""
        assert not self.features, f"encoder runner still holds images of {list(self.features)[:16]}"
        assert not self.mrope_layouts, f"encoder runner still holds M-RoPE layouts of {list(self.mrope_layouts)[:16]}"
        held = self.cache.held_req_ids
        assert not held, f"encoder cache entries still held by {held[:16]}"

    def profile_outputs(self) -> list[torch.Tensor]:
        """The encoder's outputs for a step that spends the whole encoder budget, so that a
        profile run measures the encoder's peak and its outputs' memory."""
        return self.model.embed_multimodal(self.model.dummy_mm_items(self.encoder_budget))


def make_encoder_runner(model: nn.Module, scheduler_config: SchedulerConfig, device: torch.device) -> EncoderRunner:
    """The runner of a multimodal model, its cache as large as the config says (default: one
    step's encoder budget, itself the step's token budget by default)."""
    budget = scheduler_config.max_num_encoder_input_tokens or scheduler_config.max_num_batched_tokens
    capacity = scheduler_config.encoder_cache_size if scheduler_config.encoder_cache_size is not None else budget
    return EncoderRunner(model, EncoderCache(capacity), device, budget)
