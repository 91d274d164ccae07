"""`GPUModelRunner`: turns a `SchedulerOutput` into one forward pass and sampled tokens.

The seed's chapter 5. It owns the persistent `InputBatch`, the model, the KV cache and the
static input buffers; it decides nothing about policy. Despite the name it runs on the CPU
too: the device comes from `DeviceConfig`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING

import numpy as np
import torch

from pagoda.attention.backends import AttentionLimits, AttentionMetadataBuilder, CUDAGraphSupport, get_attention_backend
from pagoda.attention.cascade import CascadeBuffers, CascadeMode, CascadePlanCache
from pagoda.attention.layer import Attention
from pagoda.attention.metadata import AttentionMetadata, CascadeMetadata
from pagoda.config import EngineConfig
from pagoda.distributed.parallel_state import get_parallel_state
from pagoda.forward_context import ForwardContext
from pagoda.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
    get_kv_cache_config,
    kv_cache_torch_dtype,
)
from pagoda.model.layers.embedding import ParallelLMHead
from pagoda.model.layers.linear import LinearBase
from pagoda.model.layers.mamba.metadata import MambaMetadataBuilder
from pagoda.model.layers.mamba.mixer import MambaMixer2
from pagoda.model.ops import GEMV_MAX_TOKENS
from pagoda.outputs import IntermediateTensors, LogprobsArrays, ModelRunnerOutput
from pagoda.pooling.runner import make_pooler, pooling_output
from pagoda.sample.logprobs import LogprobsTensors
from pagoda.sample.metadata import SamplingMetadata
from pagoda.sample.sampler import Sampler
from pagoda.sampling_params import MAX_LOGPROBS, SamplingParams
from pagoda.scheduler.block_pool import NULL_BLOCK_ID
from pagoda.scheduler.output import CachedRequestData, NewRequestData, SchedulerOutput
from pagoda.spec_decode.draft_model import DraftModelProposer
from pagoda.spec_decode.proposer import make_drafter
from pagoda.spec_decode.verification import verify_drafts
from pagoda.structured_output.spec import GrammarSpec
from pagoda.worker.async_output import AsyncGPUModelRunnerOutput, DeferredSampleOutput
from pagoda.worker.behind_verify import BehindVerify, StagedRows, staged_sizes
from pagoda.worker.cpu_gpu_buffer import CpuGpuBuffer, PackedStaging
from pagoda.worker.cuda_graph import BatchDescriptor, CudaGraphManager, CUDAGraphMode, default_capture_sizes
from pagoda.worker.input_batch import CachedRequestState, InputBatch
from pagoda.worker.kv_connector.base import KVConnector
from pagoda.worker.kv_connector.factory import make_worker_connector
from pagoda.worker.prompt_logprobs import compute_prompt_logprobs, empty_prompt_logprobs, scored_positions
from pagoda.worker.sampling_batch import OFF
from pagoda.worker.tagged_memory import TaggedMemoryPool

if TYPE_CHECKING:
    from pagoda.lora.manager import LoRAManager
    from pagoda.multimodal.encoder_runner import EncoderRunner
    from pagoda.structured_output.pipeline import GrammarPipeline, MaskRequest
    from pagoda.structured_output.state import GrammarState

logger = logging.getLogger(__name__)

# Written where a sampled token goes until its value reaches the host (async scheduling).
PLACEHOLDER_TOKEN_ID = -1

# Dummy requests of the profile run and graph capture: every sampling setting on, with penalty
# statistics and top logprobs, so the profile's peak includes the sampler's largest temporaries.
DUMMY_REQ_PREFIX = "_dummy-"
PROFILE_SAMPLING_PARAMS = SamplingParams(
    temperature=0.7,
    top_k=50,
    top_p=0.9,
    min_p=0.05,
    presence_penalty=0.5,
    frequency_penalty=0.5,
    repetition_penalty=1.1,
    logprobs=MAX_LOGPROBS,
    seed=0,
)


@dataclass(frozen=True)
class BatchExecution:
    """How a step runs: eagerly or by replaying the graph `batch_descriptor`, over
    `num_input_tokens` tokens (padding included) in `num_rows` request rows."""

    cudagraph_mode: CUDAGraphMode
    batch_descriptor: BatchDescriptor | None
    num_input_tokens: int
    num_rows: int


@dataclass
class PreparedInputs:
    """What `_prepare_inputs` hands to the forward pass and the sampler."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    forward_context: ForwardContext
    num_scheduled_tokens: int
    # Flat token index of each position that samples: the last scheduled token of each row
    # whose prompt is complete after this step, and in a verify step each of its drafts' too.
    logits_indices: torch.Tensor
    # Batch rows that sample (their prompt is complete after this step).
    sample_rows: np.ndarray
    # Per sampled row: its draft tokens this step, and its first row among the logits.
    num_drafts: np.ndarray
    logits_start: np.ndarray
    # Their sampling settings, built (and sent) before the forward.
    sampling_metadata: SamplingMetadata | None
    # In a verify step: [rows, most drafts] each sampled row's drafts (-1 padded) and its first
    # row among the logits, on the device, sent with the step's other inputs; None otherwise.
    draft_token_ids: torch.Tensor | None = None
    logits_start_device: torch.Tensor | None = None
    # The attention cascades over shared prefixes (a decode graph replays its cascade variant).
    cascade: bool = False
    # Rows scheduled behind their verify step in flight and, on the device, how far they were
    # moved back ([rows], minus that step's rejected count): see `BehindVerify`.
    behind: StagedRows | None = None
    behind_shift: torch.Tensor | None = None


@dataclass(frozen=True)
class StepTokens:
    """A step's new tokens per sampled row ([rows, n] int64, -1 past a row's last: n is 1 but
    in a verify step) and the logprobs of every sampled position, when a row asked."""

    token_ids: torch.Tensor
    logprobs: LogprobsTensors | None


def cdiv(a: int, b: int) -> int:
    return -(a // -b)


def zeroed_bytes(size: int, device: torch.device) -> torch.Tensor:
    """`size` zero bytes on `device`. On the CPU through calloc (NumPy's zeros), whose large
    blocks are fresh pages the OS zeroes on first touch: a 1 GiB KV cache costs nothing until
    blocks are used, where `torch.zeros` writes every page up front (about 0.5 s per GiB)."""
    if device.type == "cpu":
        return torch.from_numpy(np.zeros(size, dtype=np.int8))
    return torch.zeros(size, dtype=torch.int8, device=device)


class GPUModelRunner:
    def __init__(self, config: EngineConfig, device: torch.device, memory_pool: TaggedMemoryPool | None = None) -> None:
        self.config = config
        # Where the weights ("weights") and the KV cache ("kv_cache") live when sleep mode may
        # release them; None: plain torch allocations.
        self.memory_pool = memory_pool
        self.model_config = config.model_config
        self.cache_config = config.cache_config
        self.lora_config = config.lora_config
        self.scheduler_config = config.scheduler_config
        self.device = device
        self.dtype = self.model_config.dtype
        self.kv_cache_dtype = kv_cache_torch_dtype(self.cache_config.kv_cache_dtype, self.dtype)

        self.max_num_reqs = self.scheduler_config.max_num_seqs
        self.max_num_tokens = self.scheduler_config.max_num_batched_tokens
        self.max_model_len = self.model_config.max_model_len
        self.block_size = self.cache_config.block_size
        # This rank's query heads and pipeline stage (the layers declare their own KV cache).
        parallel = get_parallel_state()
        self.num_heads = self.model_config.num_attention_heads // parallel.tp_size
        self.is_first_stage, self.is_last_stage = parallel.is_first_pp_rank, parallel.is_last_pp_rank
        self.vocab_size = self.model_config.vocab_size
        self.pin_memory = device.type == "cuda"

        self.requests: dict[str, CachedRequestState] = {}
        self.sampler = Sampler(self.model_config.logprobs_mode)
        # Pooling models (task "embed") pool hidden states instead of sampling (see pagoda/pooling).
        self.pooler = make_pooler(self.model_config)
        self.kv_connector = KVConnector()
        self.attn_backend = get_attention_backend(config.device_config.attention_backend)
        self.model: torch.nn.Module | None = None
        # Set by load_model from the layers' specs: the groups (the executor's layout has the same
        # ones), a metadata builder per group, the persistent batch with a block table per group.
        self.kv_cache_config: KVCacheConfig | None = None
        self.attn_metadata_builders: list[AttentionMetadataBuilder] = []
        self.input_batch: InputBatch | None = None
        # Layer name -> its KV-cache group; layer name -> its view of the cache.
        self.layer_groups: dict[str, int] = {}
        self.kv_caches: dict[str, torch.Tensor] = {}
        # Seeds for requests that bring none: drawn from the engine seed, so runs repeat.
        self._seed_rng = np.random.default_rng(self.model_config.seed)

        # Static, max-size input buffers: every step writes into the same addresses.
        def buffer(size: int, dtype: torch.dtype) -> CpuGpuBuffer:
            return CpuGpuBuffer(size, dtype, device, self.pin_memory)

        self.buffer = buffer
        # A step's small inputs, sent in one copy (see `PackedStaging`); made with the KV-cache
        # groups, which have a slot mapping each: `_init_step_staging`.
        self.staging: PackedStaging | None = None
        # Places n-gram verify steps scheduled behind their predecessor in flight (made with the staging).
        self.behind_verify: BehindVerify | None = None
        self.input_ids: CpuGpuBuffer
        self.positions: CpuGpuBuffer
        self.slot_mappings: list[CpuGpuBuffer] = []  # one per KV-cache group
        self.query_start_loc: CpuGpuBuffer
        self.seq_lens: CpuGpuBuffer
        self.logits_indices: CpuGpuBuffer
        self.sample_rows: CpuGpuBuffer
        # Where the previous step's sampled ids go in this step's input ids (async scheduling).
        self.prev_sampled_dst: CpuGpuBuffer
        self.prev_sampled_src: CpuGpuBuffer
        num_logits_max = max(self.max_num_tokens, self.max_num_reqs)
        # The batch row of each logits row (a verify step samples a row at each of its positions).
        self.logits_rows = buffer(num_logits_max, torch.int64)
        speculative = config.speculative_config
        self.forced_acceptance = speculative.forced_acceptance if speculative is not None else None
        self._forced_acceptance_rng: torch.Generator | None = None
        if self.forced_acceptance is not None:
            self._forced_acceptance_rng = torch.Generator(device).manual_seed(self.model_config.seed)
        # A verify step's drafts and logits starts, staged in pinned memory like the inputs above.
        max_drafts = speculative.num_speculative_tokens if speculative is not None else 0
        # The most tokens a request brings to a step that only decodes: 1, or a verify step's 1 + k.
        self.decode_query_len = 1 + max_drafts
        self.draft_token_ids = buffer(self.max_num_reqs * max_drafts, torch.int64)
        # A draft model proposing after each step (built by load_model); None: the scheduler's n-grams or none.
        self.drafter: DraftModelProposer | None = make_drafter(self, speculative)
        self.logits_start = buffer(self.max_num_reqs, torch.int64)
        self.async_scheduling = bool(config.scheduler_config.async_scheduling)
        # Set by an in-process caller (one that resolves outputs on this thread): a step under
        # grammars may then return before sampling and sample at the next call (see
        # DeferredSampleOutput). Ranks in worker processes resolve outputs on a sender thread.
        self.defers_sampling = False
        self._deferred_sample: DeferredSampleOutput | None = None
        # The last step's output while its ids may still be only on the device.
        self._pending_output: AsyncGPUModelRunnerOutput | None = None
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        # Recorded once a step's host-to-device copies are queued: the pinned staging buffers
        # above may be rewritten for the next step only after those copies ran.
        self._inputs_sent = torch.cuda.Event() if device.type == "cuda" else None
        # Where a later pipeline stage receives the previous stage's tensors (static: graphs read them).
        self._intermediate_buffers: IntermediateTensors | None = None
        if not self.is_first_stage:
            hidden_size = self.model_config.text_config.hidden_size
            self._intermediate_buffers = IntermediateTensors(
                *(torch.zeros(self.max_num_tokens, hidden_size, dtype=self.dtype, device=device) for _ in range(2))
            )
        self.cudagraph_manager: CudaGraphManager | None = None
        # LoRA adapters' device slots and the step's per-token slot index (built with the model).
        self.lora_manager: LoRAManager | None = None
        # Multimodal models: the images' encoder runs and cache (set by load_model; no pipeline parallelism).
        self.encoder_runner: EncoderRunner | None = None
        # Structured output: the requests with a grammar, and what advances their grammars and
        # fills their masks off the step's critical path (made with the first one; nothing of
        # it runs while the set is empty).
        self._grammar_req_ids: set[str] = set()
        self._grammar_pipeline: GrammarPipeline | None = None
        # The last draft-free step's mask requests, by (each sampled row's grammar, logits starts).
        self._mask_requests: tuple[tuple, list[MaskRequest]] = ((), [])
        self._arange = np.arange(max(self.max_num_tokens, self.max_num_reqs) + 1, dtype=np.int64)

    # ---- setup -------------------------------------------------------------------------

    def _make_cudagraph_manager(self, graph_support: CUDAGraphSupport) -> CudaGraphManager | None:
        """Graphs need CUDA and backends that read their metadata only from device buffers."""
        compilation = self.config.compilation_config
        if self.device.type != "cuda" or compilation.enforce_eager or graph_support < CUDAGraphSupport.ALWAYS:
            return None
        if self.pooler is not None:
            return None  # pooling steps are prefills, and encoder attention reads host offsets
        limit = min(compilation.max_cudagraph_capture_size, self.max_num_tokens)
        sizes = [size for size in compilation.cudagraph_capture_sizes or default_capture_sizes(limit) if size <= limit]
        if not sizes:
            return None
        return CudaGraphManager(
            sizes,
            self.max_num_reqs,
            limit,
            cascade=not self.scheduler_config.disable_cascade_attn,
            verify_query_len=self.decode_query_len,
        )

    def load_model(self) -> None:
        from pagoda.model.loader import get_model

        self.model = get_model(self.model_config, self.attn_backend, self.device)
        if self.memory_pool is not None:
            self.memory_pool.pack_module(self.model, "weights")
        if self.drafter is not None:
            draft = self.drafter.load_model()
            if self.memory_pool is not None:
                self.memory_pool.pack_module(draft, "weights")
        if self.lora_config is not None:
            from pagoda.lora.manager import LoRAManager

            self.lora_manager = LoRAManager(
                self.model,
                self.lora_config,
                self.model_config.hf_config,
                self.max_num_tokens,
                self.device,
                self.dtype,
                use_triton=self.device.type == "cuda" or self.attn_backend.name == "triton",
            )
        if self.device.type == "cpu" and not self.config.compilation_config.enforce_eager and self.lora_config is None:
            from pagoda.model.cpu_decode import attach

            attach(self.model)
        if hasattr(self.model, "embed_multimodal"):
            from pagoda.multimodal.encoder_runner import make_encoder_runner

            self.encoder_runner = make_encoder_runner(self.model, self.scheduler_config, self.device)
            if self.device.type == "cuda" and not self.config.compilation_config.enforce_eager:
                self.encoder_runner.make_cuda_graphs()
        layers = self._attention_layers()
        self.cudagraph_manager = self._make_cudagraph_manager(
            min((layer.backend.cudagraph_support for layer in layers), default=CUDAGraphSupport.ALWAYS)
        )
        # The groups the executor's layout will have too (it groups the same specs); one block
        # for now, so the profile run has a cache to write.
        self._init_kv_cache_groups(get_kv_cache_config(self.get_kv_cache_spec(), 0, num_blocks=1))
        # Before the profile run, so that its device buffers (offload staging) count in the peak.
        self.kv_connector = make_worker_connector(self.config, self.device, self.kv_cache_config)

    def _attention_layers(self) -> list[Attention]:
        assert self.model is not None
        layers = [module for module in self.model.modules() if isinstance(module, Attention)]
        return layers + (self.drafter.layers if self.drafter is not None else [])

    def get_kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        """{layer name: what it keeps in the KV cache}, as the layers declare it: the attention
        layers (the drafter's included), then the state-space layers (`MambaMixer2`)."""
        assert self.model is not None
        specs: dict[str, KVCacheSpec] = {
            layer.layer_name: layer.get_kv_cache_spec(self.block_size, self.kv_cache_dtype)
            for layer in self._attention_layers()
        }
        checkpoints = self.cache_config.mamba_cache_mode == "align"
        for layer in self.model.modules():
            if isinstance(layer, MambaMixer2):
                specs[layer.layer_name] = layer.get_kv_cache_spec(self.block_size, self.kv_cache_dtype, checkpoints)
        return specs

    def _init_kv_cache_groups(self, kv_cache_config: KVCacheConfig) -> None:
        """Per group: a metadata builder, a slot-mapping buffer and a block table (in the batch)."""
        self.kv_cache_config = kv_cache_config
        groups = kv_cache_config.kv_cache_groups
        self.layer_groups = {name: gid for gid, group in enumerate(groups) for name in group.layer_names}
        cascade = not self.scheduler_config.disable_cascade_attn
        limits = AttentionLimits(
            self.num_heads,
            self.max_num_reqs,
            self.max_model_len,
            cascade=cascade,
            batch_invariant=self.model_config.batch_invariant,
            decode_query_len=self.decode_query_len,
        )
        # Attention groups of one spec share their builder; a state group's builder gathers its
        # own block table's state blocks into its buffers, so each has one.
        builders: dict[object, AttentionMetadataBuilder] = {}
        keys = [
            (gid, group.kv_cache_spec) if isinstance(group.kv_cache_spec, MambaSpec) else group.kv_cache_spec
            for gid, group in enumerate(groups)
        ]
        for key, group in zip(keys, groups, strict=True):
            spec = group.kv_cache_spec
            if key not in builders:
                builder_cls = (
                    MambaMetadataBuilder if isinstance(spec, MambaSpec) else self.attn_backend.get_builder_cls()
                )
                builders[key] = builder_cls(spec, limits, self.device)
        self.attn_metadata_builders = [builders[key] for key in keys]
        self._init_step_staging(
            [cascade and isinstance(group.kv_cache_spec, (FullAttentionSpec, SlidingWindowSpec)) for group in groups]
        )
        self.cascade_plans = [CascadePlanCache() for _ in groups]
        self.input_batch = InputBatch(
            max_num_reqs=self.max_num_reqs,
            max_model_len=self.max_model_len,
            block_sizes=list(kv_cache_config.block_sizes),
            vocab_size=self.vocab_size,
            device=self.device,
            pin_memory=self.pin_memory,
        )
        self.kv_caches = self._allocate_kv_caches(kv_cache_config, memory_pool=None)

    def _init_step_staging(self, cascades: list[bool]) -> None:
        """The step's small inputs in one `PackedStaging`, request-sized ones first (a decode
        step's spans then lie close together): lengths, rows, per KV-cache group its slot
        mapping and, where `cascades[gid]`, its cascade buffers (cascade steps take at most
        max_num_reqs tokens, the workspaces' size)."""
        max_reqs, max_tokens = self.max_num_reqs, self.max_num_tokens
        sizes: dict[str, tuple[int, torch.dtype]] = {
            "query_start_loc": (max_reqs + 1, torch.int32),
            "seq_lens": (max_reqs, torch.int32),
            "sample_rows": (max_reqs, torch.int64),
            "prev_sampled_dst": (max_reqs, torch.int64),
            "prev_sampled_src": (max_reqs, torch.int64),
        }
        for gid, cascade in enumerate(cascades):
            if cascade:
                sizes.update(CascadeBuffers.sizes(max_reqs, prefix=f"cascade{gid}."))
        sizes["input_ids"] = (max_tokens, torch.int64)
        sizes["positions"] = (max_tokens, torch.int64)
        sizes["logits_indices"] = (max(max_tokens, max_reqs), torch.int64)
        sizes.update({f"slot_mapping{gid}": (max_tokens, torch.int64) for gid in range(len(cascades))})
        speculative = self.config.speculative_config
        overlaps_verify = speculative is not None and self.drafter is None
        if overlaps_verify:
            sizes.update(staged_sizes(max_reqs, max_tokens))
        staging = self.staging = PackedStaging(sizes, self.device, self.pin_memory)
        host_plans = self.attn_backend.cudagraph_support < CUDAGraphSupport.ALWAYS
        self.behind_verify = BehindVerify(staging, host_plans) if overlaps_verify else None
        self.query_start_loc, self.seq_lens = staging["query_start_loc"], staging["seq_lens"]
        self.sample_rows = staging["sample_rows"]
        self.prev_sampled_dst, self.prev_sampled_src = staging["prev_sampled_dst"], staging["prev_sampled_src"]
        self.input_ids, self.positions = staging["input_ids"], staging["positions"]
        self.logits_indices = staging["logits_indices"]
        self.slot_mappings = [staging[f"slot_mapping{gid}"] for gid in range(len(cascades))]
        self.cascade_buffers = [
            CascadeBuffers(max_reqs, self.device, self.pin_memory, staging=staging, prefix=f"cascade{gid}.")
            if cascade
            else None
            for gid, cascade in enumerate(cascades)
        ]

    def reload_weights(self) -> None:
        """Fill the weights in place from the model's source (after sleep level 2 dropped them)."""
        from pagoda.model.loader.model_loader import load_weights_from_source

        load_weights_from_source(self.model, self.model_config)
        if self.drafter is not None:
            load_weights_from_source(self.drafter.model, self.drafter.draft_config)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy (HF name, tensor) pairs into the parameters in place (addresses, and so CUDA
        graphs, stay valid); returns the HF names loaded."""
        return self.model.load_weights(weights)

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        """Allocate the executor's layout: its groups must be the ones load_model found."""
        assert self.kv_cache_config is not None, "load_model first"
        if kv_cache_config.kv_cache_groups != self.kv_cache_config.kv_cache_groups:
            raise ValueError("the KV cache layout's groups differ from the groups this rank's layers form")
        self.kv_caches = {}  # drop the profile's one-block cache before allocating the real one
        self.kv_cache_config = kv_cache_config
        self.kv_caches = self._allocate_kv_caches(kv_cache_config, self.memory_pool)
        self.kv_connector.register_kv_caches(self.kv_caches, kv_cache_config)

    def _allocate_kv_caches(
        self, kv_cache_config: KVCacheConfig, memory_pool: TaggedMemoryPool | None
    ) -> dict[str, torch.Tensor]:
        """One zeroed buffer per `KVCacheTensor`, viewed by each layer sharing it in its
        backend's shape (one page per block, the same bytes for every layer of the buffer)."""
        specs = {name: group.kv_cache_spec for group in kv_cache_config.kv_cache_groups for name in group.layer_names}
        kv_caches = {}
        for tensor in kv_cache_config.kv_cache_tensors:
            if memory_pool is not None:
                raw = memory_pool.allocate("kv_cache", (tensor.size_bytes,), torch.int8)
            else:
                raw = zeroed_bytes(tensor.size_bytes, self.device)
            for name in tensor.shared_by:
                spec = specs[name]
                if isinstance(spec, MambaSpec):
                    shape = spec.cache_shape(kv_cache_config.num_blocks)
                else:
                    shape = self.attn_backend.get_kv_cache_shape(kv_cache_config.num_blocks, spec)
                kv_caches[name] = raw.view(spec.dtype).view(shape)
        return kv_caches

    @torch.inference_mode()
    def capture_model(self) -> None:
        """Capture every graph, largest first, over the real KV cache."""
        self._capture_encoder_graphs()
        if self.device.type == "cuda":
            self._warm_up_eager_linears()
        if self.cudagraph_manager is None:
            return
        start = time.perf_counter()
        free_before = torch.cuda.mem_get_info()[0]
        keys = self.cudagraph_manager.descriptors
        self._capture_graphs(self.cudagraph_manager, keys)
        if self.drafter is not None:
            self.drafter.capture_graphs(self.cudagraph_manager)
        torch.cuda.synchronize()
        logger.info(
            "captured %d CUDA graphs (decode sizes up to %d, verify up to %d requests, mixed up to %d) "
            "in %.1f s, using %.2f GiB",
            len(keys),
            max(self.cudagraph_manager.decode_sizes, default=0),
            max(self.cudagraph_manager.verify_sizes, default=0),
            max(self.cudagraph_manager.mixed_sizes, default=0),
            time.perf_counter() - start,
            (free_before - torch.cuda.mem_get_info()[0]) / 2**30,
        )

    def _warm_up_eager_linears(self) -> None:
        """Run each linear that executes outside the graphs once at each row count where its kernel
        launch changes, so Triton compiles here and not inside the first requests' steps (the LM
        head's GEMV cost the first token ~240 ms on the H200, Llama-3.1-8B shape, 2026-12-02)."""
        for module, row_counts in self._eager_linear_launches():
            in_features = module.weight.shape[1]
            for rows in row_counts:
                module(torch.zeros(rows, in_features, dtype=self.dtype, device=self.device))

    def _eager_linear_launches(self) -> list[tuple[torch.nn.Module, list[int]]]:
        """(module, row counts) for one module of each weight shape: the LM head, which the graphs
        leave out (its GEMV up to GEMV_MAX_TOKENS rows, one kernel per count), and in batch-invariant
        mode every linear too, since eager prefills run them at any count: the first count of each
        launch the invariant GEMM takes (`triton_gemv.launch_tiling` follows the row count)."""
        from pagoda.model.ops.triton_gemv import launch_change_points

        assert self.model is not None
        launches: dict[tuple[bool, tuple[int, ...], bool], tuple[torch.nn.Module, list[int]]] = {}
        for module in self.model.modules():
            is_head = isinstance(module, ParallelLMHead)
            if is_head:
                if not self.is_last_stage or self.pooler is not None:
                    continue
                batch_invariant = module.batch_invariant
            elif isinstance(module, LinearBase) and getattr(module.quant_method, "batch_invariant", False):
                batch_invariant = True
            else:
                continue
            n, k = module.weight.shape
            key = (is_head, (n, k), getattr(module, "bias", None) is not None)
            if key in launches:
                continue
            if batch_invariant:
                max_rows = self.max_num_reqs if is_head else self.max_num_tokens
                row_counts = launch_change_points(n, k, self.dtype, self.device, max_rows)
            else:
                row_counts = list(range(1, min(GEMV_MAX_TOKENS, self.max_num_tokens) + 1))
            launches[key] = (module, row_counts)
        return list(launches.values())

    @torch.inference_mode()
    def profile_cudagraph_memory(self) -> int:
        """Device bytes the graphs will take, measured before the KV cache exists.

        Captures the largest graph of each kind (their shared pool: the activations) and the
        two smallest (what each further graph adds) into a scratch manager over the one-block
        profile cache, then frees them; the estimate scales the per-graph part to every graph.
        """
        encoder_graphs = self._capture_encoder_graphs()
        manager = self.cudagraph_manager
        if manager is None:
            return encoder_graphs
        keys = manager.descriptors
        # The largest graph of each kind (mixed, decode, verify), then the two smallest.
        kinds = {(key.uniform_decode, key.decode_query_len): key for key in reversed(keys)}
        largest = list(dict.fromkeys([keys[0], *kinds.values()]))
        smallest = [key for key in keys[-2:] if key not in largest]

        def measure(scratch: CudaGraphManager, group: list[BatchDescriptor]) -> int:
            torch.cuda.synchronize()
            free_before = torch.cuda.mem_get_info()[0]
            self._capture_graphs(scratch, group)
            torch.cuda.synchronize()
            return free_before - torch.cuda.mem_get_info()[0]

        scratch = CudaGraphManager(
            manager.decode_sizes + manager.mixed_sizes,
            manager.max_decode_size,
            manager.max_mixed_size,
            verify_query_len=manager.verify_query_len,
        )
        pool_and_first = measure(scratch, largest)
        per_graph = measure(scratch, smallest) / len(smallest) if smallest else 0
        del scratch
        torch.cuda.empty_cache()
        return encoder_graphs + int(pool_and_first + per_graph * (len(keys) - len(largest)))

    def _capture_encoder_graphs(self) -> int:
        """Capture the encoder's graphs once (they need no KV cache); the device bytes they took."""
        graphs = self.encoder_runner.cuda_graphs if self.encoder_runner is not None else None
        if graphs is None or graphs.captured:
            return 0
        torch.cuda.synchronize()
        free_before = torch.cuda.mem_get_info()[0]
        graphs.capture()
        torch.cuda.synchronize()
        logger.info("captured encoder CUDA graphs for %s images", graphs.sizes)
        return free_before - torch.cuda.mem_get_info()[0]

    def _capture_graphs(self, manager: CudaGraphManager, keys: list[BatchDescriptor]) -> None:
        """Capture `keys` on dummy batches of their kind and size, over the current KV cache.

        Decode: one token per row (a verify graph: decode_query_len per row); mixed: requests
        of up to max_model_len - 1 tokens (any mix replays the same launches). Replays later
        read the real step's values from the same static buffers.
        """
        assert self.model is not None
        forward = self._forward
        for key in keys:
            size = key.num_tokens
            if key.uniform_decode:
                num_scheduled = np.full(size // key.decode_query_len, key.decode_query_len, dtype=np.int64)
            else:
                chunk = min(size, self.max_model_len - 1)
                num_scheduled = np.full(cdiv(size, chunk), chunk, dtype=np.int64)
                num_scheduled[-1] = size - chunk * (len(num_scheduled) - 1)
            execution = BatchExecution(CUDAGraphMode.FULL, key, size, self._graph_rows(key))
            with self._dummy_batch(num_scheduled, execution) as inputs:
                intermediate = self.intermediate_tensors(size)
                manager.capture(
                    key,
                    lambda ids=inputs.input_ids, pos=inputs.positions, ctx=inputs.forward_context, it=intermediate: (
                        forward(ids, pos, ctx, it)
                    ),
                )

    def _graph_rows(self, key: BatchDescriptor) -> int:
        """Request rows of the graph `key`: its launch grids are fixed at capture, so every
        replay pads its rows to this count (zero-length rows past the real ones)."""
        return key.num_rows if key.num_rows is not None else min(key.num_tokens, self.max_num_reqs)

    @contextmanager
    def _dummy_batch(self, num_scheduled: np.ndarray, execution: BatchExecution) -> Iterator[PreparedInputs]:
        """The one dummy-run path (profiling, graph capture): requests of `num_scheduled[i]`
        prompt tokens go through `_update_states` and `_prepare_inputs` like real ones, then
        leave the batch. Every block they hold is the null block, which no real request reads
        (padding and positions outside a window only)."""
        block_sizes = self.input_batch.block_table.block_sizes
        new_reqs = [
            NewRequestData(
                req_id=f"{DUMMY_REQ_PREFIX}{i}",
                prompt_token_ids=[0] * int(n),
                sampling_params=PROFILE_SAMPLING_PARAMS,
                block_ids=tuple([NULL_BLOCK_ID] * cdiv(int(n), size) for size in block_sizes),
                num_computed_tokens=0,
            )
            for i, n in enumerate(num_scheduled)
        ]
        num_tokens = {new.req_id: len(new.prompt_token_ids) for new in new_reqs}
        scheduler_output = SchedulerOutput(new_reqs, CachedRequestData(), num_tokens, int(num_scheduled.sum()))
        self._update_states(scheduler_output)
        try:
            key = execution.batch_descriptor
            cascade = CascadeMode.ALWAYS if key is not None and key.cascade else CascadeMode.OFF
            yield self._prepare_inputs(scheduler_output, execution.num_input_tokens, execution.num_rows, cascade)
        finally:
            self._update_states(SchedulerOutput([], CachedRequestData(), {}, 0, finished_req_ids=set(num_tokens)))

    @torch.inference_mode()
    def profile_run(self) -> None:
        """Run the largest batch once (forward + sampler with every setting on) so that peak
        activation memory shows; before the real cache exists, over the one-block profile cache."""
        assert self.model is not None
        num_tokens = min(self.max_num_tokens, self.max_num_reqs * (self.max_model_len - 1))
        num_reqs = min(self.max_num_reqs, num_tokens)
        query_lens = np.full(num_reqs, num_tokens // num_reqs, dtype=np.int64)
        query_lens[: num_tokens % num_reqs] += 1
        execution = BatchExecution(CUDAGraphMode.NONE, None, num_tokens, num_reqs)
        # A step's images are encoded before its forward, and their outputs live through it.
        encoder_outputs = self.encoder_runner.profile_outputs() if self.encoder_runner is not None else None
        with self._dummy_batch(query_lens, execution) as inputs:
            hidden = self._model_forward(inputs, self.intermediate_tensors(num_tokens))
            if self.is_last_stage and self.pooler is None:
                self._sample(hidden, inputs)
            del hidden, encoder_outputs

    # ---- the seed's step -----------------------------------------------------------------

    def _update_states(self, scheduler_output: SchedulerOutput) -> Callable[[], None] | None:
        """Apply the scheduler's diff to the persistent batch (the seed's phases 1-5)."""
        batch = self.input_batch
        # Phase 1: drop finished requests entirely; preempted ones leave the batch but keep
        # their state (prompt, seed), since they resume with new blocks.
        for req_id in scheduler_output.finished_req_ids:
            self.requests.pop(req_id, None)
            self._grammar_req_ids.discard(req_id)
            batch.remove_request(req_id)
        for req_id in scheduler_output.preempted_req_ids:
            batch.remove_request(req_id)
        if self.cache_config.zero_freed_blocks and scheduler_output.freed_block_ids:
            self._zero_block_ids(scheduler_output.freed_block_ids)
        # Requests not scheduled this step leave the batch too (their state stays), so the
        # batch holds exactly the rows of this step's forward.
        scheduled = scheduler_output.num_scheduled_tokens
        for req_id in [r for r in batch.req_id_to_index if r not in scheduled]:
            batch.remove_request(req_id)

        # Phase 2: new requests.
        for new_req in scheduler_output.scheduled_new_reqs:
            params = new_req.sampling_params
            seed = params.seed if params.seed is not None else int(self._seed_rng.integers(0, 2**62))
            prompt_logprobs = None
            if params.prompt_logprobs is not None:
                prompt_logprobs = empty_prompt_logprobs(len(new_req.prompt_token_ids), params.prompt_logprobs)
            state = CachedRequestState(
                req_id=new_req.req_id,
                prompt_token_ids=list(new_req.prompt_token_ids),
                sampling_params=params,
                seed=seed,
                block_ids=tuple(list(ids) for ids in new_req.block_ids),
                num_computed_tokens=new_req.num_computed_tokens,
                prompt_logprobs=prompt_logprobs,
                grammar=self._new_grammar(params),
                pooling_params=new_req.pooling_params,
                lora_request=new_req.lora_request,
            )
            self.requests[new_req.req_id] = state
            if state.grammar is not None:
                self._grammar_req_ids.add(state.req_id)
            batch.add_request(state)

        # Phases 4-5: running and resumed requests (phase 3, swaps, comes with reordering).
        cached = scheduler_output.scheduled_cached_reqs
        # The rows already in the batch and their new computed counts, written in one go.
        computed_rows: list[int] = []
        computed_counts: list[int] = []
        row_of = batch.req_id_to_index
        for i, req_id in enumerate(cached.req_ids):
            state = self.requests[req_id]
            state.num_computed_tokens = cached.num_computed_tokens[i]
            new_block_ids = cached.new_block_ids[i]
            if cached.resumed_from_preemption[i]:
                token_ids = cached.resumed_token_ids[i]
                assert token_ids is not None and new_block_ids is not None
                state.output_token_ids = list(token_ids[len(state.prompt_token_ids) :])
                state.block_ids = tuple(list(ids) for ids in new_block_ids)
                if state.grammar is not None:
                    self._grammars().join()
                    state.grammar.sync(state.output_token_ids)
            elif new_block_ids is not None:
                for group, ids in zip(state.block_ids, new_block_ids, strict=True):
                    group.extend(ids)
            if cached.new_token_ids and cached.new_token_ids[i]:
                self._write_new_token_ids(state, cached.new_token_ids[i])
            row = row_of.get(req_id)
            if row is None:
                batch.add_request(state)
                continue
            computed_rows.append(row)
            computed_counts.append(state.num_computed_tokens)
            if new_block_ids is not None:
                batch.block_table.append_row(new_block_ids, row)
        batch.num_computed_tokens[computed_rows] = computed_counts

        # Phase 6: draft tokens to verify, after each row's known tokens (not part of its history).
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        for req_id, token_ids in spec_tokens.items():
            row = batch.get_req_index(req_id)
            assert row is not None, f"drafts for {req_id!r}, which is not in the batch"
            batch.update_req_spec_token_ids(row, token_ids)
        batch.condense()
        if not spec_tokens:
            return None

        def correct_spec_decode_token_counts() -> None:
            """After the step: the drafts are spent (the accepted ones come back as its tokens)."""
            batch.num_spec_tokens[: batch.num_reqs] = 0

        return correct_spec_decode_token_counts

    def _new_grammar(self, params: SamplingParams) -> GrammarState | None:
        """A fresh grammar state for a structured request. The engine core compiled the grammar
        before scheduling the request; in its process the backend's cache has it already."""
        if params.structured_outputs is None:
            return None
        # xgrammar loads with the first grammar.
        from pagoda.structured_output.backend import get_backend
        from pagoda.structured_output.state import GrammarState

        compiled = get_backend(self.model_config).compile(GrammarSpec.of(params.structured_outputs))
        return GrammarState(compiled, params.structured_outputs)

    def _grammars(self) -> GrammarPipeline:
        """What advances the grammars and fills their masks (made with the first use): room for
        a mask per logits row of a verify step, plus the masks its thread filled ahead."""
        if self._grammar_pipeline is None:
            from pagoda.structured_output.backend import get_backend
            from pagoda.structured_output.pipeline import GrammarPipeline

            speculative = self.config.speculative_config
            positions = 1 + (speculative.num_speculative_tokens if speculative is not None else 0)
            mask_vocab_size = get_backend(self.model_config).mask_vocab_size
            self._grammar_pipeline = GrammarPipeline(self.max_num_reqs * (positions + 2), mask_vocab_size, self.device)
        return self._grammar_pipeline

    def _write_new_token_ids(self, state: CachedRequestState, token_ids: list[int]) -> None:
        """Tokens sampled since the request last ran, sent under pipeline parallelism (only the
        last stage samples); they start at its first uncomputed output position. The last
        stage has them already, and rewrites the same values."""
        start = max(state.num_computed_tokens, len(state.prompt_token_ids))
        index = start - len(state.prompt_token_ids)
        state.output_token_ids[index : index + len(token_ids)] = token_ids
        row = self.input_batch.get_req_index(state.req_id)
        if row is not None:
            end = start + len(token_ids)
            self.input_batch.token_ids_cpu[row, start:end] = token_ids
            self.input_batch.num_tokens[row] = max(int(self.input_batch.num_tokens[row]), end)

    def _zero_block_ids(self, block_ids: list[int]) -> None:
        """The seed's KV block zeroer: one indexed write per cache buffer (through its first
        layer's view: the layers sharing it lay pages out alike), K and V together."""
        index = torch.tensor(block_ids, dtype=torch.long).to(self.device, non_blocking=True)
        assert self.kv_cache_config is not None
        for tensor in self.kv_cache_config.kv_cache_tensors:
            self.kv_caches[tensor.shared_by[0]].index_fill_(1, index, 0)

    def _prepare_inputs(
        self,
        scheduler_output: SchedulerOutput,
        num_input_tokens: int,
        num_rows: int,
        cascade: CascadeMode = CascadeMode.OFF,
    ) -> PreparedInputs:
        """Input ids, positions and attention metadata for this step, vectorized in NumPy.

        Tokens past the scheduled ones, up to `num_input_tokens` (a CUDA graph's size), are
        padding: id 0, position 0, slot -1 (writes nowhere); request rows past the real ones,
        up to `num_rows`, have length 0.
        """
        batch = self.input_batch
        num_reqs = batch.num_reqs
        num_scheduled = np.fromiter(
            (scheduler_output.num_scheduled_tokens[r] for r in batch.req_ids), dtype=np.int64, count=num_reqs
        )
        total = int(num_scheduled.sum())
        cu_num_tokens = np.cumsum(num_scheduled)
        req_indices = np.repeat(self._arange[:num_reqs], num_scheduled)
        offsets = self._arange[:total] - np.repeat(cu_num_tokens - num_scheduled, num_scheduled)
        num_computed = batch.num_computed_tokens[:num_reqs].astype(np.int64)
        positions = num_computed[req_indices] + offsets
        if self.lora_manager is not None:
            row_loras = [self.requests[req_id].lora_request for req_id in batch.req_ids]
            self.lora_manager.set_batch(row_loras, num_scheduled, num_input_tokens)

        self.positions.np[:total] = positions
        self.input_ids.np[:total] = batch.token_ids_cpu[req_indices, positions]
        self.input_ids.np[total:num_input_tokens] = 0
        self.positions.np[total:num_input_tokens] = 0
        for table, block_size, slot_mapping in zip(
            batch.block_table.tables, batch.block_table.block_sizes, self.slot_mappings, strict=True
        ):
            block_ids = table.block_table_np[req_indices, positions // block_size]
            slot_mapping.np[:total] = block_ids.astype(np.int64) * block_size + positions % block_size
            slot_mapping.np[total:num_input_tokens] = -1
        if self.encoder_runner is not None:  # M-RoPE: rotary positions past images differ from indices
            self.encoder_runner.shift_positions(
                batch.req_ids, cu_num_tokens - num_scheduled, num_scheduled, self.positions.np
            )

        seq_lens = num_computed + num_scheduled
        sample_rows = np.flatnonzero(seq_lens >= batch.num_tokens[:num_reqs])
        # A verify row samples after its last known token and after each of its drafts.
        num_drafts = batch.num_spec_tokens[sample_rows].astype(np.int64)
        num_logits = num_drafts + 1
        logits_start = np.cumsum(num_logits) - num_logits
        num_sampled = int(num_logits.sum())
        first_index = np.repeat(cu_num_tokens[sample_rows] - num_logits - logits_start, num_logits)
        self.logits_indices.np[:num_sampled] = first_index + self._arange[:num_sampled]

        # Everything staged is sent in one copy, before any device work reads it.
        assert self.staging is not None
        stage = self.staging.stage
        group_metadata = self._build_attention_metadata(
            num_input_tokens, num_rows, num_scheduled, cu_num_tokens, seq_lens, cascade
        )
        behind_ids = scheduler_output.behind_verify
        prev_sampled = self._stage_prev_sampled(num_computed, num_scheduled, cu_num_tokens - num_scheduled, behind_ids)
        input_ids = stage(self.input_ids, num_input_tokens)
        positions_device = stage(self.positions, num_input_tokens)
        logits_indices = stage(self.logits_indices, num_sampled)
        rows_device = None
        if 0 < len(sample_rows) < num_reqs:
            self.sample_rows.np[: len(sample_rows)] = sample_rows
            rows_device = stage(self.sample_rows, len(sample_rows))
        behind = None
        if behind_ids:
            assert self.behind_verify is not None
            # The scheduler laid the step out from its count: its first sample at num_computed + 1.
            output_delta = num_computed + 1 - batch.num_tokens[:num_reqs]
            behind = self.behind_verify.stage(
                batch.req_ids,
                behind_ids,
                num_scheduled,
                cu_num_tokens - num_scheduled,
                sample_rows,
                logits_start,
                output_delta,
                self.input_ids.np,
                batch.token_ids_cpu,
                batch.num_tokens,
            )
        self.staging.send()

        behind_shift = None
        if behind is not None:
            assert self.behind_verify is not None
            behind_shift = self.behind_verify.place(
                behind,
                self.input_ids.gpu,
                self.positions.gpu,
                self.seq_lens.gpu,
                self.seq_lens.cpu,
                [slot_mapping.gpu for slot_mapping in self.slot_mappings],
                batch.block_table,
            )
        forward_context = self._forward_context(group_metadata)
        if prev_sampled is not None:
            self._scatter_prev_sampled(input_ids, *prev_sampled)
        draft_token_ids = logits_start_device = None
        if num_drafts.any():
            draft_token_ids = self._send_drafts(sample_rows, num_drafts)
            self.logits_start.np[: len(sample_rows)] = logits_start
            logits_start_device = self.logits_start.copy_to_gpu(len(sample_rows))
        sampling_metadata = (
            self._sampling_metadata(sample_rows, rows_device, num_drafts, logits_start)
            if self.is_last_stage and self.pooler is None
            else None
        )
        if behind is not None and sampling_metadata is not None:
            assert behind_shift is not None
            BehindVerify.key_samples(behind, behind_shift, sampling_metadata.output_positions)
        return PreparedInputs(
            input_ids=input_ids,
            positions=positions_device,
            forward_context=forward_context,
            num_scheduled_tokens=total,
            logits_indices=logits_indices,
            sample_rows=sample_rows,
            num_drafts=num_drafts,
            logits_start=logits_start,
            sampling_metadata=sampling_metadata,
            draft_token_ids=draft_token_ids,
            logits_start_device=logits_start_device,
            cascade=any(m.cascade is not None for m in forward_context.attn_metadata.values()),
            behind=behind,
            behind_shift=behind_shift,
        )

    def _stage_prev_sampled(
        self, num_computed: np.ndarray, num_scheduled: np.ndarray, first_token: np.ndarray, behind: set[str]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Where the previous step's sampled ids, still unknown to the host, go in this step's
        input ids (the host wrote placeholders there): (the pending device ids, the staged
        indices among them, the staged input positions), or None when none go. Rows behind
        their verify step (`behind`) are placed by `BehindVerify` instead."""
        pending = self._pending_output
        if pending is None or pending.resolved:
            return None
        req_ids = self.input_batch.req_ids
        # Each row's index among the pending step's sampled rows (-1: it did not sample then).
        indices = pending.sampled_index_of_rows(req_ids)
        rows = np.flatnonzero(indices >= 0)
        indices = indices[rows]
        # A request runs again behind its verify step only as the scheduler says (see Scheduler).
        drafted = pending.num_drafts[indices] != 0
        if drafted.any():
            unplaced = [req_ids[row] for row in rows[drafted].tolist() if req_ids[row] not in behind]
            assert not unplaced, f"{unplaced[0]!r} scheduled behind its verify step, not marked so"
            rows, indices = rows[~drafted], indices[~drafted]
        offsets = pending.positions[indices].astype(np.int64) - num_computed[rows]
        in_step = (offsets >= 0) & (offsets < num_scheduled[rows])
        num = int(in_step.sum())
        if not num:
            return None
        assert pending.sampled_token_ids is not None and self.staging is not None
        self.prev_sampled_dst.np[:num] = first_token[rows[in_step]] + offsets[in_step]
        self.prev_sampled_src.np[:num] = indices[in_step]
        return (
            pending.sampled_token_ids,
            self.staging.stage(self.prev_sampled_src, num),
            self.staging.stage(self.prev_sampled_dst, num),
        )

    @staticmethod
    def _scatter_prev_sampled(
        input_ids: torch.Tensor, sampled_token_ids: torch.Tensor, src: torch.Tensor, dst: torch.Tensor
    ) -> None:
        """Copy the previous step's sampled ids into this step's input ids, on the device."""
        input_ids.index_copy_(0, dst, sampled_token_ids[src, 0])

    def _sampling_metadata(
        self,
        sample_rows: np.ndarray,
        rows_device: torch.Tensor | None,
        num_drafts: np.ndarray,
        logits_start: np.ndarray,
    ) -> SamplingMetadata | None:
        """Sampling settings of the rows that sample, sent before the forward with the inputs:
        in a verify step one entry per position (see `SamplingBatch.metadata`); `rows_device`:
        the sampled rows on the device, None when every row samples; `logits_start`: each
        sampled row's first row among the logits."""
        if len(sample_rows) == 0:
            return None
        if not num_drafts.any():
            return self.input_batch.sampling_metadata(sample_rows, rows_device)
        num_logits = num_drafts + 1
        logits_rows = np.repeat(sample_rows, num_logits)
        offsets = self._arange[: len(logits_rows)] - np.repeat(logits_start, num_logits)
        self.logits_rows.np[: len(logits_rows)] = logits_rows
        return self.input_batch.sampling_metadata(logits_rows, self.logits_rows.copy_to_gpu(len(logits_rows)), offsets)

    def _build_attention_metadata(
        self,
        num_input_tokens: int,
        num_rows: int,
        num_scheduled: np.ndarray,
        cu_num_tokens: np.ndarray,
        seq_lens: np.ndarray,
        cascade: CascadeMode = CascadeMode.OFF,
    ) -> list[AttentionMetadata]:
        """Per KV-cache group, its block table and slot mapping with the common query offsets
        and lengths, for `num_rows` request rows (at least the real ones; the rest have length
        0), staged but not yet sent (`_forward_context` makes them the layers' metadata after).
        The seed's cascade-attention prefix lengths: with `cascade` AUTO, each group whose
        requests share leading blocks where that pays (`plan_cascade`) gets its cascade metadata;
        ALWAYS gives it even without a shared prefix (capturing a cascade graph)."""
        assert self.staging is not None
        stage = self.staging.stage
        num_reqs = len(num_scheduled)
        num_total = int(cu_num_tokens[-1])
        self.query_start_loc.np[0] = 0
        self.query_start_loc.np[1 : num_reqs + 1] = cu_num_tokens
        self.query_start_loc.np[num_reqs + 1 : num_rows + 1] = num_total
        self.seq_lens.np[:num_reqs] = seq_lens
        self.seq_lens.np[num_reqs:num_rows] = 0
        query_start_loc = stage(self.query_start_loc, num_rows + 1)
        seq_lens_device = stage(self.seq_lens, num_rows)
        block_table = self.input_batch.block_table
        max_query_len, max_seq_len = int(num_scheduled.max()), int(seq_lens.max())
        return [
            AttentionMetadata(
                num_reqs=num_rows,
                num_actual_tokens=num_total,
                max_query_len=max_query_len,
                max_seq_len=max_seq_len,
                block_size=block_size,
                query_start_loc=query_start_loc,
                seq_lens=seq_lens_device,
                block_table=table.commit(num_rows),
                slot_mapping=stage(slot_mapping, num_input_tokens),
                query_start_loc_cpu=self.query_start_loc.cpu[: num_rows + 1],
                seq_lens_cpu=self.seq_lens.cpu[:num_rows],
                cascade=self._cascade_metadata(gid, cascade, num_scheduled, seq_lens, num_input_tokens, num_rows),
            )
            for gid, (table, block_size, slot_mapping) in enumerate(
                zip(block_table.tables, block_table.block_sizes, self.slot_mappings, strict=True)
            )
        ]

    def _forward_context(self, group_metadata: list[AttentionMetadata]) -> ForwardContext:
        """The step's `ForwardContext`: each group's metadata made into its layers' by the group's
        builder (which may run device work over it: only once the staged inputs are sent)."""
        built = [
            builder.build(common) for builder, common in zip(self.attn_metadata_builders, group_metadata, strict=True)
        ]
        return ForwardContext(
            attn_metadata={name: built[gid] for name, gid in self.layer_groups.items()},
            kv_caches=self.kv_caches,
        )

    def _cascade_metadata(
        self,
        gid: int,
        cascade: CascadeMode,
        num_scheduled: np.ndarray,
        seq_lens: np.ndarray,
        num_input_tokens: int,
        num_rows: int,
    ) -> CascadeMetadata | None:
        """KV-cache group `gid`'s shared-prefix split of this step, or None (plain attention)."""
        buffers = self.cascade_buffers[gid]
        if cascade == CascadeMode.OFF or buffers is None or max(num_input_tokens, num_rows) > buffers.max_tokens:
            return None
        plan = None
        if cascade == CascadeMode.AUTO:
            assert self.kv_cache_config is not None
            spec = self.kv_cache_config.kv_cache_groups[gid].kv_cache_spec
            block_table = self.input_batch.block_table
            plan = self.cascade_plans[gid].plan(
                block_table[gid].layout_version,
                block_table[gid].block_table_np[: len(num_scheduled)],
                seq_lens - num_scheduled,
                seq_lens,
                block_table.block_sizes[gid],
                spec.sliding_window if isinstance(spec, SlidingWindowSpec) else None,
            )
            if plan is None:
                return None
        return buffers.build(plan, num_scheduled, num_input_tokens, num_rows)

    def _determine_batch_execution_and_padding(self, scheduler_output: SchedulerOutput) -> BatchExecution:
        """A batch replays the graph of its kind of the nearest captured size above it: uniform
        decode (one token per request), verify (at most 1 + k per request, more than one in
        all, at least half the graph's tokens: a speculative verify step, its rows padded to
        the graph's) or mixed; a batch larger than every graph runs eagerly, unpadded."""
        num_tokens = scheduler_output.total_num_scheduled_tokens
        num_reqs = len(scheduler_output.num_scheduled_tokens)
        if self.encoder_runner is not None and self.encoder_runner.step_has_embeddings(
            scheduler_output.num_scheduled_tokens, self.requests
        ):
            return BatchExecution(CUDAGraphMode.NONE, None, num_tokens, num_reqs)  # graphs embed token ids only
        layerwise = self.kv_connector.uses_layerwise_hooks and scheduler_output.kv_connector_metadata is not None
        manager = self.cudagraph_manager
        if manager is not None and not layerwise:
            key = None
            if num_tokens > num_reqs and max(scheduler_output.num_scheduled_tokens.values()) <= self.decode_query_len:
                key = manager.verify_descriptor_for(num_reqs)
                # At least half its tokens real (a uniform step always is: graph sizes at most
                # double); sparser drafts pad less in a mixed graph (its matmuls see fewer rows).
                if key is not None and 2 * num_tokens < key.num_tokens:
                    key = None
            if key is None:
                key = manager.descriptor_for(num_tokens, uniform_decode=num_tokens == num_reqs)
            if key is not None:
                return BatchExecution(CUDAGraphMode.FULL, key, key.num_tokens, self._graph_rows(key))
        return BatchExecution(CUDAGraphMode.NONE, None, num_tokens, num_reqs)

    def _cascade_mode(self, execution: BatchExecution) -> CascadeMode:
        """AUTO where a cascade can run: eagerly, or in a decode graph (captured in both variants);
        mixed and verify graphs replay plain attention."""
        if self.scheduler_config.disable_cascade_attn:
            return CascadeMode.OFF
        key = execution.batch_descriptor
        decode_graph = key is not None and key.uniform_decode and key.decode_query_len == 1
        if execution.cudagraph_mode == CUDAGraphMode.FULL and not decode_graph:
            return CascadeMode.OFF
        return CascadeMode.AUTO

    def _execute_mm_encoder(self, scheduler_output: SchedulerOutput, inputs: PreparedInputs) -> None:
        """The seed's step 3: encode the step's scheduled images (cached by content hash) and hand
        the forward the encoder output rows its chunks place, with the flat tokens they replace."""
        assert self.encoder_runner is not None
        self.encoder_runner.execute(scheduler_output)
        batch = self.input_batch
        num_reqs = batch.num_reqs
        mm_embeddings = self.encoder_runner.gather(
            batch.req_ids,
            batch.num_computed_tokens[:num_reqs],
            np.diff(self.query_start_loc.np[: num_reqs + 1]),
            self.query_start_loc.np[:num_reqs],
        )
        if mm_embeddings is not None:
            inputs.forward_context = replace(inputs.forward_context, mm_embeddings=mm_embeddings)

    def _model_forward(
        self, inputs: PreparedInputs, intermediate_tensors: IntermediateTensors | None
    ) -> torch.Tensor | IntermediateTensors:
        return self._forward(inputs.input_ids, inputs.positions, inputs.forward_context, intermediate_tensors)

    def _forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        context: ForwardContext,
        intermediate_tensors: IntermediateTensors | None,
    ) -> torch.Tensor | IntermediateTensors:
        """The model's forward, then a draft model's over the same tokens (its KV, see
        `DraftModelProposer.catch_up`): one eager run or one captured graph for both."""
        assert self.model is not None
        hidden_states = self.model(input_ids, positions, context, intermediate_tensors)
        if self.drafter is not None:
            self.drafter.catch_up(input_ids, positions, context)
        return hidden_states

    def intermediate_tensors(self, num_tokens: int) -> IntermediateTensors | None:
        """The static buffers a later pipeline stage receives `num_tokens` rows into (None on the first)."""
        buffers = self._intermediate_buffers
        if buffers is None:
            return None
        return IntermediateTensors(buffers.hidden_states[:num_tokens], buffers.residual[:num_tokens])

    def num_input_tokens(self, scheduler_output: SchedulerOutput) -> int:
        """Tokens the forward of this step runs on, padding included: what stages hand each other."""
        return self._determine_batch_execution_and_padding(scheduler_output).num_input_tokens

    def _sample(self, hidden_states: torch.Tensor, inputs: PreparedInputs) -> StepTokens | None:
        """Logits only at the positions that sample; partial prefill chunks sample nothing
        (but score their prompt tokens for requests that asked for prompt logprobs). A verify
        step keeps the drafts the model's own samples agree with (`verify_drafts`)."""
        self._score_prompt_tokens(hidden_states)
        metadata = inputs.sampling_metadata
        if metadata is None:
            return None
        assert self.model is not None
        logits = self.model.compute_logits(hidden_states[inputs.logits_indices])
        output = self.sampler(logits, metadata)
        if inputs.draft_token_ids is not None:
            assert inputs.logits_start_device is not None
            token_ids = verify_drafts(
                output.sampled_token_ids,
                inputs.logits_start_device,
                inputs.draft_token_ids,
                self.forced_acceptance,
                self._forced_acceptance_rng,
            )
        else:
            token_ids = output.sampled_token_ids[:, None]
        sample_rows = inputs.sample_rows
        rows_device = (
            None if len(sample_rows) == self.input_batch.num_reqs else self.sample_rows.gpu[: len(sample_rows)]
        )
        self.input_batch.sampling.record_sampled(sample_rows, rows_device, token_ids)
        return StepTokens(token_ids, output.logprobs)

    def _send_drafts(self, sample_rows: np.ndarray, num_drafts: np.ndarray) -> torch.Tensor:
        """[rows, most drafts] int64 on the device: each sampled row's drafts, -1 padded, staged
        in the pinned buffer (an unpinned copy would make the host wait for the device)."""
        batch = self.input_batch
        width = int(num_drafts.max())
        columns = batch.num_tokens[sample_rows][:, None].astype(np.int64) + self._arange[:width]
        staged = self.draft_token_ids.np[: len(sample_rows) * width].reshape(len(sample_rows), width)
        staged[:] = batch.token_ids_cpu[sample_rows[:, None], columns]
        staged[self._arange[:width] >= num_drafts[:, None]] = -1
        return self.draft_token_ids.copy_to_gpu(staged.size).view(len(sample_rows), width)

    def _score_prompt_tokens(self, hidden_states: torch.Tensor) -> None:
        """Fill the prompt-logprobs buffers of the rows that asked, for the prompt tokens this step's chunk scores."""
        batch = self.input_batch
        num_reqs = batch.num_reqs
        rows = np.flatnonzero(batch.sampling.num_prompt_logprobs[:num_reqs] >= 0)
        if len(rows) == 0:
            return
        assert self.model is not None
        query_starts = self.query_start_loc.np[rows].astype(np.int64)
        query_lens = self.query_start_loc.np[rows + 1] - query_starts
        chunk_starts = batch.num_computed_tokens[rows].astype(np.int64)
        counts, hidden_index, positions = scored_positions(
            chunk_starts, query_starts, query_lens, batch.num_prompt_tokens[rows].astype(np.int64)
        )
        if len(positions) == 0:
            return
        scored = compute_prompt_logprobs(
            self.model.compute_logits,
            hidden_states,
            hidden_index,
            batch.token_ids_cpu[np.repeat(rows, counts), positions],
            num_top=int(batch.sampling.num_prompt_logprobs[rows].max()),
            normalize=self.sampler.logprobs_mode.endswith("logprobs"),
        )
        # Buffer row p - 1 holds prompt token p; each request keeps its own number of top columns.
        first = 0
        for row, start, count in zip(rows.tolist(), chunk_starts.tolist(), counts.tolist(), strict=True):
            buffer = self.requests[batch.req_ids[row]].prompt_logprobs
            assert buffer is not None
            width = buffer.token_ids.shape[1]
            part = scored.select(slice(first, first + count), width - 1)
            buffer.token_ids[start : start + count] = part.token_ids
            buffer.logprobs[start : start + count] = part.logprobs
            buffer.ranks[start : start + count] = part.ranks
            first += count

    def _bookkeeping_sync(
        self, inputs: PreparedInputs, sampler_output: StepTokens | None, draft_token_ids: torch.Tensor | None = None
    ) -> ModelRunnerOutput | AsyncGPUModelRunnerOutput:
        """Record the step in the batch and start the sampled ids' trip to the host (with the
        draft model's proposals for the next step, if any).

        The host does not wait for them: each sampled row gets a placeholder token, replaced
        when the output is resolved (`_record_sampled_tokens`). A verify row's tokens, as many
        as it accepted, are appended then (it does not run again before).
        """
        batch = self.input_batch
        req_ids = list(batch.req_ids)
        if sampler_output is None:
            if self.behind_verify is not None:
                self.behind_verify.record(None, None)
            return ModelRunnerOutput(
                req_ids=req_ids,
                req_id_to_index={req_id: row for row, req_id in enumerate(req_ids)},
                sampled_token_ids=[[] for _ in req_ids],
            )
        sample_rows = inputs.sample_rows
        positions = batch.num_tokens[sample_rows].copy()
        position_shifts = None
        if inputs.behind is not None:
            # Where the scheduler laid the rows out, and how far the device moved them back.
            assert inputs.behind_shift is not None
            positions[inputs.behind.sample_index] = batch.num_computed_tokens[inputs.behind.rows] + 1
            position_shifts = BehindVerify.sample_shifts(inputs.behind, inputs.behind_shift, len(sample_rows))
        plain_rows = sample_rows[inputs.num_drafts == 0]
        batch.append_sampled_tokens(plain_rows, PLACEHOLDER_TOKEN_ID)
        for row in plain_rows.tolist():
            self.requests[req_ids[row]].output_token_ids.append(PLACEHOLDER_TOKEN_ID)
        # A request's prompt is complete once it samples: deliver its prompt logprobs now, once.
        prompt_logprobs: dict[str, LogprobsArrays] = {}
        sampling = batch.sampling
        for row in sample_rows[sampling.num_prompt_logprobs[sample_rows] >= 0].tolist():
            state = self.requests[req_ids[row]]
            assert state.prompt_logprobs is not None
            prompt_logprobs[state.req_id] = state.prompt_logprobs
            state.prompt_logprobs = None
            sampling.num_prompt_logprobs[row] = OFF
        output = AsyncGPUModelRunnerOutput(
            req_ids=req_ids,
            sample_rows=sample_rows,
            positions=positions,
            num_drafts=inputs.num_drafts,
            logits_start=inputs.logits_start,
            sampled_token_ids=sampler_output.token_ids,
            logprobs=sampler_output.logprobs,
            prompt_logprobs=prompt_logprobs,
            copy_stream=self._copy_stream,
            on_ready=self._record_sampled_tokens,
            draft_token_ids=draft_token_ids,
            position_shifts=position_shifts,
        )
        self._pending_output = output
        if self.behind_verify is not None:
            self.behind_verify.record(output, sampler_output.token_ids)
        if self._grammar_req_ids:
            self._advance_grammars(output)
        return output

    def _advance_grammars(self, output: AsyncGPUModelRunnerOutput) -> None:
        """Hand the step's grammar rows to the pipeline's thread, which advances them over the
        step's tokens once they reach the host (reading no grammar state here: a job may run)."""
        from pagoda.structured_output.pipeline import SampledGrammarRow

        rows = []
        for index, (row, position) in enumerate(
            zip(output.sample_rows.tolist(), output.positions.tolist(), strict=True)
        ):
            state = self.requests[output.req_ids[row]]
            if state.grammar is not None:
                rows.append(SampledGrammarRow(state.grammar, index, position - len(state.prompt_token_ids)))
        self._grammars().advance(rows, output.host_token_ids)

    def _record_sampled_tokens(self, output: AsyncGPUModelRunnerOutput, sampled: np.ndarray) -> None:
        """Put a resolved step's ids where its placeholders are, wherever its requests now live;
        append a verify row's tokens."""
        batch = self.input_batch
        requests = self.requests
        req_ids = output.req_ids
        plain = output.num_drafts == 0
        for i in np.flatnonzero(~plain).tolist():
            state = requests.get(req_ids[output.sample_rows[i]])
            if state is not None:  # else finished since
                position = int(output.positions[i])
                tokens = sampled[i]
                self._append_verified(
                    state, position - len(state.prompt_token_ids), position, tokens[tokens >= 0].tolist()
                )
        rows, positions, token_ids = output.sample_rows[plain], output.positions[plain], sampled[plain, 0]
        for row, position, token_id in zip(rows.tolist(), positions.tolist(), token_ids.tolist(), strict=True):
            state = requests.get(req_ids[row])
            if state is not None:  # else finished since
                index = position - len(state.prompt_token_ids)
                if index < len(state.output_token_ids):
                    state.output_token_ids[index] = token_id
        # Where the rows' requests live now (-1: out of the batch): the same rows while the batch
        # keeps its order, the common case.
        if batch.req_ids != req_ids:
            where = batch.req_id_to_index
            rows = np.fromiter((where.get(req_ids[row], -1) for row in rows.tolist()), dtype=np.int64, count=len(rows))
        placed = (rows >= 0) & (positions < batch.num_tokens[rows])
        batch.token_ids_cpu[rows[placed], positions[placed]] = token_ids[placed]

    def _append_verified(self, state: CachedRequestState, index: int, position: int, token_ids: list[int]) -> None:
        """A verify step's tokens join the request's history (and its batch row, if it has one).
        Drafts of the step being prepared, staged where the tokens land (a step behind this
        one, resolved early), move behind them."""
        if index != len(state.output_token_ids):
            return  # preempted and resumed since: the scheduler sent the history it kept
        state.output_token_ids.extend(token_ids)
        batch = self.input_batch
        row = batch.get_req_index(state.req_id)
        if row is not None and batch.num_tokens[row] == position:
            end = position + len(token_ids)
            num_spec = int(batch.num_spec_tokens[row])
            if num_spec:
                drafts = batch.token_ids_cpu[row, position : position + num_spec].copy()
                batch.token_ids_cpu[row, end : end + num_spec] = drafts
            batch.token_ids_cpu[row, position:end] = token_ids
            batch.num_tokens[row] += len(token_ids)

    def _resolve_pending_output(self) -> None:
        """Wait for the previous step's ids, for work that needs the host's token history."""
        if self._pending_output is not None:
            self._pending_output.get_output()
            self._pending_output = None

    def _fill_grammar_bitmask(self, inputs: PreparedInputs) -> None:
        """Give the sampler the grammar masks of the constrained rows that sample this step.

        Called once the forward is queued. The grammars advance over the previous step's ids
        and fill their masks on the pipeline's thread meanwhile (see GrammarPipeline); this
        fills what the thread does not (new rows, a verify row's positions) and queues the
        masks' copy on a side stream, behind the thread's job on the device, that the sampler
        waits for: the host does not wait. Nothing runs when no request has a grammar.
        """
        metadata = inputs.sampling_metadata
        if not self._grammar_req_ids or metadata is None:
            return
        from pagoda.structured_output.pipeline import MaskRequest

        batch = self.input_batch
        requests_by_id = self.requests
        sample_rows = inputs.sample_rows.tolist()
        grammars = tuple(requests_by_id[batch.req_ids[row]].grammar for row in sample_rows)
        starts = inputs.logits_start.tolist()
        if inputs.num_drafts.any():
            requests = []
            for row, grammar, num_drafts, logits_start in zip(
                sample_rows, grammars, inputs.num_drafts.tolist(), starts, strict=True
            ):
                if grammar is None:
                    continue
                drafts = ()
                if num_drafts:
                    start = int(batch.num_tokens[row])
                    drafts = batch.token_ids_cpu[row, start : start + num_drafts].tolist()
                requests.append(MaskRequest(grammar, logits_start, drafts))
        else:
            # A decode step's rows mostly repeat the last one's, and so do its requests: reused
            # then, since building a tuple a row costs more than the rest of this path.
            key = (grammars, starts)
            cached_key, requests = self._mask_requests
            if key != cached_key:
                requests = [MaskRequest(g, start) for g, start in zip(grammars, starts, strict=True) if g is not None]
                self._mask_requests = (key, requests)
        metadata.grammar_bitmask = self._grammars().masks(requests)

    def _needs_host_history(self) -> bool:
        """Bad words are matched on the host against the output so far, the last token included."""
        batch = self.input_batch
        return bool(batch.sampling.bad_words.present[: batch.num_reqs].any())

    @torch.inference_mode()
    def execute_model(
        self, scheduler_output: SchedulerOutput, intermediate_tensors: IntermediateTensors | None = None
    ) -> ModelRunnerOutput | AsyncGPUModelRunnerOutput | DeferredSampleOutput | IntermediateTensors:
        """One step. With async scheduling the output's ids may still be in flight; the caller
        resolves it with `get_output()` (at the latest before the step after next). With
        `defers_sampling`, a step under grammars returns before it samples (at the next call).

        A pipeline stage after the first starts from `intermediate_tensors` (received into
        `intermediate_tensors(num_input_tokens)`); a stage before the last returns the tensors
        for the next stage and samples nothing."""
        self._sample_deferred()
        # First: a save of blocks this step reuses must be queued before the block zeroer runs.
        self.kv_connector.bind_connector_metadata(scheduler_output.kv_connector_metadata)
        if self.kv_connector.can_skip_forward(scheduler_output):
            return self.kv_connector.no_forward(scheduler_output)
        if self._inputs_sent is not None:
            self._inputs_sent.synchronize()
        post_model_execute_cb = self._update_states(scheduler_output)
        if self.encoder_runner is not None:
            self.encoder_runner.update(scheduler_output)
        if scheduler_output.total_num_scheduled_tokens == 0:
            return self.kv_connector.no_forward(scheduler_output)
        if self._needs_host_history():
            self._resolve_pending_output()
        # Padding is decided first, so the inputs are written straight at the graph's size.
        execution = self._determine_batch_execution_and_padding(scheduler_output)
        # A step with rows behind a verify step has host lengths that are only upper bounds: no cascade.
        cascade = CascadeMode.OFF if scheduler_output.behind_verify else self._cascade_mode(execution)
        inputs = self._prepare_inputs(scheduler_output, execution.num_input_tokens, execution.num_rows, cascade)
        if self._inputs_sent is not None:
            self._inputs_sent.record()
        if self.encoder_runner is not None:
            self._execute_mm_encoder(scheduler_output, inputs)
        self.kv_connector.pre_forward(scheduler_output)
        if self.kv_connector.uses_layerwise_hooks and execution.cudagraph_mode == CUDAGraphMode.NONE:
            inputs.forward_context = replace(inputs.forward_context, kv_connector=self.kv_connector)
        if execution.cudagraph_mode == CUDAGraphMode.FULL:
            assert self.cudagraph_manager is not None and execution.batch_descriptor is not None
            hidden_states = self.cudagraph_manager.replay(replace(execution.batch_descriptor, cascade=inputs.cascade))
        else:
            hidden_states = self._model_forward(inputs, intermediate_tensors)
        if isinstance(hidden_states, IntermediateTensors):
            return hidden_states
        self.kv_connector.post_forward(scheduler_output, hidden_states)
        if self.pooler is not None:
            pooled = pooling_output(
                self.pooler,
                hidden_states,
                self.input_batch,
                self.requests,
                self.query_start_loc.np,
                inputs.sample_rows,
                self.model_config.pooling_needs_whole_prompt,
            )
            pooled.kv_connector_output = self.kv_connector.get_finished()
            return pooled
        if self.defers_sampling and self.async_scheduling and self._grammar_req_ids:
            self._deferred_sample = DeferredSampleOutput(
                partial(self._sample_and_record, inputs, hidden_states, post_model_execute_cb)
            )
            return self._deferred_sample
        output = self._sample_and_record(inputs, hidden_states, post_model_execute_cb)
        if not self.async_scheduling and isinstance(output, AsyncGPUModelRunnerOutput):
            return output.get_output()
        return output

    @torch.inference_mode()
    def _sample_and_record(
        self,
        inputs: PreparedInputs,
        hidden_states: torch.Tensor,
        post_model_execute_cb: Callable[[], None] | None,
    ) -> ModelRunnerOutput | AsyncGPUModelRunnerOutput:
        """The step after its forward: masks, sampling, drafts, and the step's record."""
        self._fill_grammar_bitmask(inputs)
        sampler_output = self._sample(hidden_states, inputs)
        drafts = None
        if self.drafter is not None:
            token_ids = sampler_output.token_ids if sampler_output is not None else None
            drafts = self.drafter.propose(inputs, hidden_states, token_ids, inputs.sampling_metadata)
        output = self._bookkeeping_sync(inputs, sampler_output, drafts)
        output.kv_connector_output = self.kv_connector.get_finished()
        if post_model_execute_cb is not None:
            post_model_execute_cb()
        return output

    def _sample_deferred(self) -> None:
        """Queue the previous step's deferred sampling, if any (before this step touches the
        batch it read)."""
        if self._deferred_sample is not None:
            self._deferred_sample.sample()
            self._deferred_sample = None
