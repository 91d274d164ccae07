"""Engine configuration: one dataclass per concern, gathered in `EngineConfig`.

A leaf module: it imports nothing from pagoda but the leaf `pagoda.cpu_platform` (every layer
imports it). Resolving user settings against the model
(`pagoda.engine.arg_utils.create_engine_config`) lives in the engine, which may import the
model loader.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from pagoda.cpu_platform import usable_cpu_count


class ConfigError(ValueError):
    """An invalid engine setting; the message names the field and the limit."""


# What sampled-token logprobs report: the model's own distribution (raw), or the one sampled
# from after penalties, bias, bans, temperature and truncation (processed; truncated tokens get
# -inf), as log probabilities or as the logits themselves. The sampler implements each mode.
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
# Values of ModelConfig.quantization (None: the checkpoint's own) and CacheConfig.kv_cache_dtype.
QUANTIZATION_METHODS = (None, "fp8")
KV_CACHE_DTYPES = ("auto", "fp8")
# How a GGUF's 4-bit linear weights (Q4_0, Q4_1) load: kept 4-bit for the CPU's int4 kernel
# ("quantized"), kept as the file's blocks for Pagoda's AVX2 / AVX-512 kernels ("blocks"), or dequantized
# to the model dtype; "auto": quantized for a bf16 model on an AVX-512 CPU, else blocks where
# their kernels build (pagoda/model/layers/quantization/config.py).
GGUF_WEIGHTS = ("auto", "quantized", "blocks", "dequantized")
# State-space layers' prefix caching (vLLM's names): "none", one state per request and no
# caching; "align", a state checkpoint at every block boundary (steps end on boundaries they
# reach), so a cached prefix resumes from the checkpoint at its end.
MAMBA_CACHE_MODES = ("none", "align")
# Values of CacheConfig.kv_role (disaggregated prefill, pagoda/kv_transfer/disagg; None: neither).
KV_ROLES = ("producer", "consumer")

# What the engine serves: "generate" samples tokens; "embed" pools hidden states (no sampler);
# "auto" picks from the architecture (encoders such as BertModel embed, decoders generate).
TASKS = ("auto", "generate", "embed")
# How a pooling model turns a prompt's hidden states into one vector (see pagoda/pooling/pooler.py).
POOLING_TYPES = ("LAST", "MEAN", "CLS")
# HF model types of encoder-only models: they embed, and keep no KV cache.
ENCODER_MODEL_TYPES = ("bert",)
# Models without attention or positions (a recurrent state per request), whose length is not
# capped by the model: their default max_model_len.
ATTENTION_FREE_MODEL_TYPES = ("mamba2",)
# Models with state-space layers (attention-free or hybrid): a recurrent state per request, no
# prefix caching (see KVCacheManager).
STATE_SPACE_MODEL_TYPES = ("mamba2", "bamba")
STATE_SPACE_MAX_MODEL_LEN = 131072


@dataclass(frozen=True)
class PoolerConfig:
    """How an embedding model pools: `pooling_type` (LAST, MEAN or CLS) and whether the vector is
    L2-normalized. None: the model's own (its sentence-transformers files, else its family's)."""

    pooling_type: str | None = None
    normalize: bool | None = None

    def __post_init__(self) -> None:
        if self.pooling_type is not None and self.pooling_type not in POOLING_TYPES:
            raise ConfigError(
                f"pooler_config.pooling_type must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}"
            )
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ConfigError(f"pooler_config.normalize must be true or false, got {self.normalize!r}")


@dataclass
class DeviceConfig:
    device: str = "auto"
    attention_backend: str = "auto"
    # CPU device: torch's compute threads, set once when the worker starts; None: every CPU the
    # process may run on (its affinity). More would oversubscribe the cores.
    cpu_threads: int | None = None

    def __post_init__(self) -> None:
        usable = usable_cpu_count()
        if self.cpu_threads is None:
            self.cpu_threads = usable
        if (
            isinstance(self.cpu_threads, bool)
            or not isinstance(self.cpu_threads, int)
            or not 1 <= self.cpu_threads <= usable
        ):
            raise ConfigError(
                f"cpu_threads must be an integer in [1, {usable}] (the CPUs this process may run on), "
                f"got {self.cpu_threads!r}"
            )
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ConfigError(f"device must be 'cpu', 'cuda' or 'auto', got {self.device!r}")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError("device is 'cuda' but torch sees no CUDA device")
        if self.attention_backend == "auto":
            self.attention_backend = "triton" if self.is_cuda else "torch"
        if self.attention_backend not in ("torch", "triton"):
            raise ConfigError(f"attention_backend must be 'auto', 'torch' or 'triton', got {self.attention_backend!r}")
        if self.attention_backend == "triton" and not self.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise ConfigError("attention_backend 'triton' needs device 'cuda' (or TRITON_INTERPRET=1 on the CPU)")

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")


@dataclass
class ModelConfig:
    """The model to serve. `model=None` means the default SmolLM2-135M-Instruct GGUF."""

    model: str | None = None
    tokenizer: str | None = None
    load_format: str = "auto"
    dtype: str | torch.dtype = "auto"
    max_model_len: int | None = None
    seed: int = 0
    # What sampled-token logprobs report: raw_logprobs, raw_logits, processed_logprobs or
    # processed_logits (after penalties, temperature and truncation); see LOGPROBS_MODES.
    logprobs_mode: str = "raw_logprobs"
    # Where sampling defaults come from: "auto" (the model's generation_config.json, or its GGUF
    # general.sampling.* metadata), "vllm" (none: SamplingParams' neutral defaults), or a folder
    # holding a generation_config.json.
    generation_config: str = "auto"
    # "generate", "embed" or "auto" (see TASKS); resolved against the architecture.
    task: str = "auto"
    # An embedding model's pooling; resolved (both fields set) for task "embed", else None.
    pooler_config: PoolerConfig | None = None
    # "fp8": FP8 weights, quantized at load from a bf16/fp16 checkpoint; None: as the checkpoint is
    # (an FP8 checkpoint's quantization_config resolves this to "fp8").
    quantization: str | None = None
    # A GGUF's 4-bit linear weights: "quantized", "blocks", "dequantized" or "auto" (see GGUF_WEIGHTS).
    gguf_weights: str = "auto"
    # Every kernel of the forward computes a row in an order that no other row, nor their count,
    # changes (pagoda/engine/batch_invariance.py says what it covers and refuses).
    batch_invariant: bool = False
    hf_config: Any = field(default=None, repr=False)
    # Derived from generation_config: SamplingParams fields the model recommends (e.g. temperature),
    # applied wherever a user leaves the field unset.
    default_sampling: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ConfigError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got {self.logprobs_mode!r}")
        if self.task not in TASKS:
            raise ConfigError(f"task must be one of {', '.join(TASKS)}, got {self.task!r}")
        if self.quantization not in QUANTIZATION_METHODS:
            raise ConfigError(f"quantization must be 'fp8' or unset, got {self.quantization!r}")
        if self.gguf_weights not in GGUF_WEIGHTS:
            raise ConfigError(f"gguf_weights must be one of {', '.join(GGUF_WEIGHTS)}, got {self.gguf_weights!r}")

    @property
    def is_embedding_model(self) -> bool:
        """Runs the forward without a sampler and returns pooled hidden states."""
        return self.task == "embed"

    @property
    def is_encoder_only(self) -> bool:
        """Bidirectional attention over the whole prompt, no KV cache kept (BERT)."""
        return getattr(self.hf_config, "model_type", None) in ENCODER_MODEL_TYPES

    @property
    def pooling_needs_whole_prompt(self) -> bool:
        """Every prompt token's hidden state in one step: mean and CLS pooling, and encoders (their
        attention sees the whole prompt). Last-token pooling of a decoder may chunk and hit the cache."""
        if not self.is_embedding_model:
            return False
        assert self.pooler_config is not None
        return self.is_encoder_only or self.pooler_config.pooling_type != "LAST"

    @property
    def has_recurrent_state(self) -> bool:
        """State-space layers keep one state per request: nothing of a prompt is shared or cached."""
        return getattr(self.hf_config, "model_type", None) in STATE_SPACE_MODEL_TYPES

    @property
    def text_config(self) -> Any:
        """The decoder's config: the HF config itself, or a vision-language model's `text_config`."""
        get_text_config = getattr(self.hf_config, "get_text_config", None)
        return get_text_config() if get_text_config is not None else self.hf_config

    @property
    def num_layers(self) -> int:
        return self.text_config.num_hidden_layers

    @property
    def num_attention_heads(self) -> int:
        """Query heads; an attention-free Mamba-2 model's SSM heads (what tensor parallelism would split)."""
        heads = getattr(self.text_config, "num_attention_heads", None)
        return heads if heads is not None else self.text_config.num_heads

    @property
    def num_kv_heads(self) -> int:
        return getattr(self.text_config, "num_key_value_heads", None) or self.num_attention_heads

    @property
    def head_size(self) -> int:
        head_dim = getattr(self.text_config, "head_dim", None)
        return head_dim or self.text_config.hidden_size // self.num_attention_heads

    @property
    def vocab_size(self) -> int:
        return self.text_config.vocab_size

    @property
    def derived_max_model_len(self) -> int:
        """The model's position limit; an attention-free model (Mamba-2: no positions) has none,
        so STATE_SPACE_MAX_MODEL_LEN."""
        limit = getattr(self.text_config, "max_position_embeddings", None)
        if limit is None and getattr(self.hf_config, "model_type", None) in ATTENTION_FREE_MODEL_TYPES:
            return STATE_SPACE_MAX_MODEL_LEN
        return int(limit or 2048)


@dataclass
class CacheConfig:
    block_size: int = 16
    num_gpu_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_gib: float = 1.0
    enable_prefix_caching: bool = True
    # Zero KV blocks whose contents died (freed uncached, or evicted from the prefix cache), so
    # no request can ever read another's stale keys and values, at the cost of one write per block.
    zero_freed_blocks: bool = False
    # Allocate the weights and the KV cache as tagged memory that sleep mode can release and
    # restore in place (CUDA virtual memory on a GPU; see pagoda/worker/tagged_memory.py).
    enable_sleep_mode: bool = False
    # "auto": K/V in the model dtype; "fp8": e4m3 with per-tensor scales (the checkpoint's
    # k_scale/v_scale, else 1), half the bytes per token.
    kv_cache_dtype: str = "auto"
    # CPU offload (pagoda/kv_transfer/offload): GiB of (pinned) host memory that keeps blocks the
    # device prefix cache evicts, loaded back on a later hit instead of recomputed; 0: off.
    kv_offload_gib: float = 0.0
    # With offload: also copy every cached block of a request when it ends (its blocks are held
    # until copied), so an eviction later finds it on the host already.
    kv_offload_save_on_finish: bool = False
    # With offload: when waiting prompts do not fit, swap out decoding requests (newest first,
    # each at most once) for them: their KV goes to the host and comes back on resume, so
    # first tokens come at the prefill rate even when the pool holds few contexts (at the
    # cost of the swapped requests' next token).
    kv_offload_prompts_first: bool = False
    # Seconds a request may wait for its KV to load before it recomputes instead.
    kv_load_timeout_s: float = 30.0
    # Disaggregated prefill (pagoda/kv_transfer/disagg): a producer holds a prefilled request's
    # blocks for a consumer to pull; a consumer pulls them instead of recomputing the prompt.
    kv_role: str | None = None
    # Seconds a producer holds a finished request's blocks for a pull before it frees them.
    kv_hold_timeout_s: float = 60.0
    # The producer's control socket (ZMQ address); None: a private ipc path chosen at startup.
    kv_transfer_address: str | None = None
    mamba_cache_mode: str = "none"

    def __post_init__(self) -> None:
        if self.mamba_cache_mode not in MAMBA_CACHE_MODES:
            raise ConfigError(
                f"mamba_cache_mode must be one of {', '.join(MAMBA_CACHE_MODES)}, got {self.mamba_cache_mode!r}"
            )
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two >= 1, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.num_gpu_blocks is not None and self.num_gpu_blocks < 2:
            raise ConfigError(f"num_gpu_blocks must be >= 2 (one is the null block), got {self.num_gpu_blocks}")
        if self.cpu_kv_cache_gib <= 0:
            raise ConfigError(f"cpu_kv_cache_gib must be > 0, got {self.cpu_kv_cache_gib}")
        if not 0 <= self.kv_offload_gib < float("inf"):
            raise ConfigError(f"kv_offload_gib must be >= 0 (0: no CPU offload), got {self.kv_offload_gib}")
        if not self.kv_load_timeout_s > 0:
            raise ConfigError(f"kv_load_timeout_s must be > 0, got {self.kv_load_timeout_s}")
        if self.kv_role is not None and self.kv_role not in KV_ROLES:
            raise ConfigError(f"kv_role must be one of {', '.join(KV_ROLES)} (or None), got {self.kv_role!r}")
        if not self.kv_hold_timeout_s > 0:
            raise ConfigError(f"kv_hold_timeout_s must be > 0, got {self.kv_hold_timeout_s}")
        if self.kv_role is not None and self.kv_offload_gib:
            raise ConfigError("kv_role and kv_offload_gib are two KV connectors; an engine runs one")
        if self.kv_role is not None and not self.enable_prefix_caching:
            raise ConfigError(f"kv_role {self.kv_role!r} needs prefix caching (transfers are checked by block hashes)")
        if self.kv_offload_prompts_first and not self.kv_offload_gib:
            raise ConfigError("kv_offload_prompts_first needs kv_offload_gib (swapped requests resume from the host)")
        if self.kv_offload_gib and not self.enable_prefix_caching:
            raise ConfigError("kv_offload_gib needs prefix caching (the host pool is keyed by its block hashes)")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}"
            )


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    # Schedule step N+1 while the device runs step N (a batch queue of depth 2); None: on for CUDA.
    async_scheduling: bool | None = None
    max_model_len: int = 0
    # Requests (each of n samples counts) a server lets wait for a place in the batch; more are refused.
    max_num_queued_requests: int = 4096
    # Cascade attention (pagoda/attention/cascade.py): requests sharing leading KV blocks read them
    # once per step together, where that pays; True always runs plain attention.
    disable_cascade_attn: bool = False
    # Multimodal models: encoder output tokens (image placeholders) one step may compute; None: the
    # step's token budget. `encoder_cache_size`: encoder output tokens the runner keeps for reuse by
    # later requests with the same image once no running request holds them; None: the same.
    max_num_encoder_input_tokens: int | None = None
    encoder_cache_size: int | None = None

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_queued_requests < 1:
            raise ConfigError(f"max_num_queued_requests must be >= 1, got {self.max_num_queued_requests}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ConfigError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")


@dataclass
class CompilationConfig:
    """CUDA graphs: captured for uniform decode batches of up to the largest capture size
    (padded up to the nearest size) when the device is CUDA, the attention backend is Triton
    and `enforce_eager` is off. On the CPU `enforce_eager` likewise turns off the one-call decode
    step of GGUF block models (`pagoda.model.cpu_decode`): every step then runs layer by layer."""

    enforce_eager: bool = False
    cudagraph_capture_sizes: list[int] | None = None
    max_cudagraph_capture_size: int = 512

    def __post_init__(self) -> None:
        if self.cudagraph_capture_sizes is not None and (
            not self.cudagraph_capture_sizes or min(self.cudagraph_capture_sizes) < 1
        ):
            raise ConfigError(f"cudagraph_capture_sizes must be positive integers, got {self.cudagraph_capture_sizes}")
        if self.max_cudagraph_capture_size < 1:
            raise ConfigError(f"max_cudagraph_capture_size must be >= 1, got {self.max_cudagraph_capture_size}")


@dataclass
class ParallelConfig:
    """How many ranks run the model, and how their worker processes are started.

    `distributed_executor_backend`: "uni" (one worker in the engine's process; world size 1
    only), "mp" (one local process per rank), "ray" (Ray actors, across machines); None picks
    "uni" at world size 1, else "mp".
    """

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    distributed_init_method: str | None = None
    # Tensor-parallel all-reduces of up to 4 MiB on CUDA go through a one-shot kernel over
    # symmetric memory (see pagoda/distributed/one_shot.py); True: NCCL for every size.
    disable_custom_all_reduce: bool = False

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.pipeline_parallel_size < 1:
            raise ConfigError(f"pipeline_parallel_size must be >= 1, got {self.pipeline_parallel_size}")
        if self.distributed_executor_backend is None:
            self.distributed_executor_backend = "uni" if self.world_size == 1 else "mp"
        if self.distributed_executor_backend not in EXECUTOR_BACKENDS:
            raise ConfigError(
                f"distributed_executor_backend must be one of {', '.join(EXECUTOR_BACKENDS)}, "
                f"got {self.distributed_executor_backend!r}"
            )
        if self.distributed_executor_backend == "uni" and self.world_size > 1:
            raise ConfigError(
                f"distributed_executor_backend 'uni' runs one rank, but tensor_parallel_size x "
                f"pipeline_parallel_size is {self.world_size}: use 'mp' or 'ray'"
            )

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def driver_rank(self) -> int:
        """TP rank 0 of the last pipeline stage: the rank whose step output the engine reads.
        Ranks below it belong to earlier stages, which hand hidden states on instead."""
        return (self.pipeline_parallel_size - 1) * self.tensor_parallel_size

    def check_model(self, model_config: ModelConfig) -> None:
        """The model must split evenly: query heads and the KV heads (or the ranks sharing
        one KV head) across TP ranks, at least one layer per pipeline stage."""
        tp = self.tensor_parallel_size
        heads, kv_heads = model_config.num_attention_heads, model_config.num_kv_heads
        if heads % tp:
            raise ConfigError(f"tensor_parallel_size must divide the model's {heads} attention heads, got {tp}")
        if kv_heads % tp and tp % kv_heads:
            raise ConfigError(
                f"tensor_parallel_size must divide the model's {kv_heads} KV heads or be a multiple of them, got {tp}"
            )
        if self.pipeline_parallel_size > model_config.num_layers:
            raise ConfigError(
                f"pipeline_parallel_size must be <= the model's {model_config.num_layers} layers, "
                f"got {self.pipeline_parallel_size}"
            )
        if self.pipeline_parallel_size > 1 and hasattr(model_config.hf_config, "vision_config"):
            raise ConfigError(
                "vision-language models run without pipeline parallelism: pipeline_parallel_size must be 1"
            )


EXECUTOR_BACKENDS = ("uni", "mp", "ray")

SPECULATIVE_METHODS = ("ngram", "draft_model", "eagle", "eagle3")
# Drafts per verify step: each costs a query token per request and a logits row; past this the
# chance that every draft holds is negligible for any proposer.
MAX_SPECULATIVE_TOKENS = 16
# Longest n-gram prompt lookup matches: longer ones cost more to match and almost never hit.
MAX_PROMPT_LOOKUP = 32


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: a proposer drafts up to `num_speculative_tokens` tokens per step and
    the model verifies them in one forward (k + 1 query tokens per request).

    `ngram` looks the last `prompt_lookup_max` .. `prompt_lookup_min` tokens up in the request's
    own prompt and output and drafts what followed; `draft_model`, `eagle` and `eagle3` need
    `model` (a draft checkpoint or head). `forced_acceptance` is benchmark-only (see
    `pagoda.benchmarks`): each draft is accepted with that probability whatever the model says, so
    the outputs are not the model's; `from_value` refuses it. `draft_model_config` is derived
    (the resolved draft of `draft_model`, see `pagoda.spec_decode.draft_config`), never set.
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    model: str | None = None
    forced_acceptance: float | None = None
    draft_model_config: ModelConfig | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ConfigError(
                f"speculative_config.method must be one of {', '.join(SPECULATIVE_METHODS)}, got {self.method!r}"
            )
        _check_int("num_speculative_tokens", self.num_speculative_tokens, 1, MAX_SPECULATIVE_TOKENS)
        _check_int("prompt_lookup_min", self.prompt_lookup_min, 1, MAX_PROMPT_LOOKUP)
        _check_int("prompt_lookup_max", self.prompt_lookup_max, self.prompt_lookup_min, MAX_PROMPT_LOOKUP)
        if self.method == "ngram" and self.model is not None:
            raise ConfigError("speculative_config.model is for draft_model, eagle and eagle3; ngram takes none")
        if self.method != "ngram" and not self.model:
            raise ConfigError(f"speculative_config.model is required for method {self.method!r}")
        alpha = self.forced_acceptance
        if alpha is not None and (
            isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 <= alpha <= 1
        ):
            raise ConfigError(f"speculative_config.forced_acceptance must be in [0, 1], got {alpha!r}")

    @classmethod
    def from_value(cls, value: SpeculativeConfig | dict[str, Any] | str) -> SpeculativeConfig:
        """From `LLM(speculative_config=...)` or `--speculative-config` (a dict or its JSON text)."""
        if isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as error:
                raise ConfigError(f"speculative_config must be a JSON object: {error}") from error
        if not isinstance(value, dict):
            raise ConfigError(f"speculative_config must be a dict (a JSON object), got {type(value).__name__}")
        if "forced_acceptance" in value:
            raise ConfigError(
                "speculative_config.forced_acceptance is benchmark-only (its outputs are not the model's): "
                "use `pagoda bench latency/throughput --forced-acceptance ALPHA`"
            )
        names = {f.name for f in fields(cls)} - {"forced_acceptance", "draft_model_config"}
        unknown = sorted(set(value) - names)
        if unknown:
            raise ConfigError(f"unknown speculative_config keys {unknown}; known: {sorted(names)}")
        missing = [name for name in ("method", "num_speculative_tokens") if name not in value]
        if missing:
            raise ConfigError(f"speculative_config needs {' and '.join(missing)}")
        return cls(**value)


def _check_int(name: str, value: Any, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ConfigError(f"speculative_config.{name} must be an integer in [{low}, {high}], got {value!r}")


# Largest adapter rank the slots hold (the limit; the kernels pad ranks to a power of two >= 16).
MAX_LORA_RANK = 64


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA adapters (`LLM(enable_lora=True, ...)`): `max_loras` device slots, hence at most that
    many distinct adapters per step; adapters up to rank `max_lora_rank`; `max_cpu_loras` adapters
    kept loaded in CPU memory (None: `max_loras`), so a slot refills without reading the files."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        for name, low, high in (("max_loras", 1, 1024), ("max_lora_rank", 1, MAX_LORA_RANK)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise ConfigError(f"{name} must be an integer in [{low}, {high}], got {value!r}")
        cpu = self.max_cpu_loras
        if cpu is not None and (isinstance(cpu, bool) or not isinstance(cpu, int) or cpu < self.max_loras):
            raise ConfigError(f"max_cpu_loras must be an integer >= max_loras ({self.max_loras}), got {cpu!r}")

    @property
    def cpu_cache_size(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras


@dataclass
class EngineConfig:
    """Build one from user settings with `pagoda.engine.arg_utils.create_engine_config(**kwargs)`."""

    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig
    device_config: DeviceConfig
    compilation_config: CompilationConfig = field(default_factory=CompilationConfig)
    speculative_config: SpeculativeConfig | None = None
    lora_config: LoRAConfig | None = None
