"""The physical floor of a benchmark figure: bytes the GPU must read over the copy bandwidth,
and FLOPs it must compute over the matmul rate, both measured on the same device in the same
run. The byte and FLOP counts are pure functions of the model's shape, so they can be checked
by hand (Llama-3.1-8B in bf16 reads 15.0 GB of weights per decode step).

A mixture of experts reads, of its routed experts, only those some token of the step picks:
at one token its k of E per layer (Qwen3-30B-A3B: 3.3B of 30.5B parameters), and, under the
uniform routing load-balanced training aims at, a share 1 - (1 - k/E)^T of them for T tokens;
it computes with k of E experts per token.

Bytes per value come from `ByteWidths`: FP8 weights (`quantization="fp8"`) read one byte per
decoder-body parameter (the LM head and embeddings stay in the activation dtype), an FP8 KV
cache one byte per cached value. FLOPs are counted at the activation dtype's matmul rate."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig


@dataclass(frozen=True)
class ModelShape:
    """Parameter counts and attention sizes: what a forward pass reads and computes. The input
    embedding is left out of the counts: each token reads one row of it, never all of it."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    # Everything but the input embedding and the LM head: decoder layers and the final norm.
    body_params: int
    lm_head_params: int
    # Of body_params, the routed experts' (0 for a dense model), and how many a token takes.
    expert_params: int = 0
    num_experts: int = 0
    experts_per_token: int = 0
    # Layers that attend (the rest of a hybrid are state-space layers); None: all of them.
    num_attention_layers: int | None = None
    # Values of one request's recurrent state over all state-space layers (conv + SSM states),
    # read and written once per decode step whatever the context.
    state_values_per_request: int = 0

    @property
    def active_body_params(self) -> int:
        """Body parameters one token computes with: the dense ones and k of E experts."""
        if not self.expert_params:
            return self.body_params
        return self.body_params - self.expert_params + self.expert_params * self.experts_per_token // self.num_experts

    def body_params_read(self, num_tokens: int) -> int:
        """Body parameters a forward over `num_tokens` tokens reads: the dense ones, and the
        expected share of the routed experts that uniform routing of those tokens picks."""
        if not self.expert_params:
            return self.body_params
        share = 1 - (1 - self.experts_per_token / self.num_experts) ** num_tokens
        return self.body_params - self.expert_params + round(self.expert_params * share)

    @property
    def kv_values_per_token(self) -> int:
        """K and V values one token keeps in the cache, over all layers."""
        layers = self.num_layers if self.num_attention_layers is None else self.num_attention_layers
        return 2 * layers * self.num_kv_heads * self.head_dim


@dataclass(frozen=True)
class ByteWidths:
    """Bytes per value read: decoder-body weights, activations (the LM head, embedding rows)
    and cached K/V. The body's norms and MoE routers stay unquantized under FP8, but they are
    well under 0.1% of its parameters, so the body is counted at one width."""

    body: int
    activation: int
    kv: int

    @classmethod
    def uniform(cls, num_bytes: int) -> ByteWidths:
        return cls(num_bytes, num_bytes, num_bytes)

    @classmethod
    def of(cls, dtype: torch.dtype, quantization: str | None, kv_cache_dtype: str) -> ByteWidths:
        """The widths an engine with these settings reads (FP8: one byte)."""
        activation = torch.empty((), dtype=dtype).element_size()
        return cls(
            body=1 if quantization == "fp8" else activation,
            activation=activation,
            kv=1 if kv_cache_dtype == "fp8" else activation,
        )


def model_shape(hf_config: PretrainedConfig) -> ModelShape:
    """Counted on the meta device from the HF model class, so every bias and norm is included."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    unique = {id(p): p.numel() for p in model.parameters()}
    embedding = model.get_input_embeddings().weight
    lm_head = model.get_output_embeddings().weight
    tied = lm_head is embedding
    body = sum(unique.values()) - embedding.numel() - (0 if tied else lm_head.numel())
    num_heads = getattr(hf_config, "num_attention_heads", None)
    experts = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    # An attention-free model (Mamba-2) keeps no K/V per token, only its fixed-size state.
    attention_free = num_heads is None
    num_state_layers, state_values = state_space_layers(hf_config)
    return ModelShape(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        num_heads=0 if attention_free else num_heads,
        num_kv_heads=0 if attention_free else getattr(hf_config, "num_key_value_heads", None) or num_heads,
        head_dim=0 if attention_free else getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads,
        body_params=body,
        lm_head_params=lm_head.numel(),
        expert_params=experts,
        num_experts=(getattr(hf_config, "num_experts", None) or getattr(hf_config, "num_local_experts", 0))
        if experts
        else 0,
        experts_per_token=getattr(hf_config, "num_experts_per_tok", 0) if experts else 0,
        num_attention_layers=hf_config.num_hidden_layers - num_state_layers if num_state_layers else None,
        state_values_per_request=num_state_layers * state_values,
    )


def state_space_layers(hf_config: PretrainedConfig) -> tuple[int, int]:
    """(Mamba-2 layers, values of one layer's conv + SSM state per request) of a Mamba-2 or Bamba
    config; (0, 0) for other models."""
    from pagoda.model.layers.mamba.mixer import MambaMixerShape

    model_type = getattr(hf_config, "model_type", None)
    if model_type == "mamba2":
        shape, layers = MambaMixerShape.of_mamba2(hf_config), hf_config.num_hidden_layers
    elif model_type == "bamba":
        shape = MambaMixerShape.of_hybrid(hf_config)
        layers = sum(kind == "linear_attention" for kind in hf_config.layers_block_type)
    else:
        return 0, 0
    conv = shape.conv_dim * (shape.conv_kernel - 1)
    return layers, conv + shape.num_heads * shape.head_dim * shape.state_size


def weight_bytes_per_step(
    shape: ModelShape, num_tokens: int, widths: ByteWidths, routed_tokens: int | None = None
) -> int:
    """Weights one forward pass reads: the body (of its experts, those `routed_tokens` tokens
    pick, by default the `num_tokens` embedded) and the LM head once, one embedding row per token."""
    body = shape.body_params_read(num_tokens if routed_tokens is None else routed_tokens)
    return body * widths.body + (shape.lm_head_params + num_tokens * shape.hidden_size) * widths.activation


def kv_bytes(shape: ModelShape, num_tokens: int, widths: ByteWidths) -> int:
    """Bytes of K and V cached for `num_tokens` tokens."""
    return num_tokens * shape.kv_values_per_token * widths.kv


def attention_flops(shape: ModelShape, num_query_key_pairs: int) -> int:
    """QK^T and PV: 2 matmuls x 2 FLOPs per multiply-add, per head and layer."""
    return 4 * shape.num_layers * shape.num_heads * shape.head_dim * num_query_key_pairs


@dataclass(frozen=True)
class Work:
    bytes_read: int
    flops: int


def decode_step_work(shape: ModelShape, context_lens: list[int], widths: ByteWidths) -> Work:
    """One decode step of a batch whose requests attend over `context_lens` tokens each (and
    read and write their recurrent states, in the model dtype, if it has state-space layers)."""
    batch = len(context_lens)
    total_context = sum(context_lens)
    state_traffic = 2 * batch * shape.state_values_per_request * widths.activation
    return Work(
        bytes_read=weight_bytes_per_step(shape, batch, widths) + kv_bytes(shape, total_context, widths) + state_traffic,
        flops=2 * (shape.active_body_params + shape.lm_head_params) * batch + attention_flops(shape, total_context),
    )


def prefill_work(shape: ModelShape, prompt_len: int, chunk_size: int, widths: ByteWidths) -> Work:
    """A prompt prefilled in chunks of `chunk_size` tokens, logits for its last token only.

    Each chunk reads the weights once and the cached K/V of the chunks before it (a single
    chunk reads none); attention is causal, so token i attends over i + 1 keys."""
    chunk_starts = range(0, prompt_len, chunk_size)
    weight_reads = sum(
        weight_bytes_per_step(shape, 0, widths, routed_tokens=min(chunk_size, prompt_len - start))
        for start in chunk_starts
    )
    embedding_rows = prompt_len * shape.hidden_size * widths.activation
    return Work(
        bytes_read=weight_reads + embedding_rows + sum(kv_bytes(shape, start, widths) for start in chunk_starts),
        flops=2 * shape.active_body_params * prompt_len
        + 2 * shape.lm_head_params
        + attention_flops(shape, prompt_len * (prompt_len + 1) // 2),
    )


@dataclass(frozen=True)
class DeviceRates:
    copy_bytes_per_s: float
    matmul_flops_per_s: float

    def floor_seconds(self, work: Work) -> float:
        """The slower of reading every byte and computing every FLOP at the measured rates."""
        return max(work.bytes_read / self.copy_bytes_per_s, work.flops / self.matmul_flops_per_s)


def workload_floor_seconds(
    shape: ModelShape,
    prompt_lens: list[int],
    output_lens: list[int],
    chunk_size: int,
    widths: ByteWidths,
    rates: DeviceRates,
) -> float:
    """A lower bound on running a batch of requests that all fit at once: every prompt prefilled
    (packed into steps of `chunk_size` tokens, each reading the weights once; the K/V reads
    of later chunks are left out), then one decode step per output token after the first,
    reading the weights once and the K/V of every request still running."""
    total_prompt = sum(prompt_lens)
    prefill = Work(
        bytes_read=math.ceil(total_prompt / chunk_size)
        * weight_bytes_per_step(shape, 0, widths, routed_tokens=min(chunk_size, total_prompt))
        + total_prompt * shape.hidden_size * widths.activation,
        flops=2 * shape.active_body_params * total_prompt
        + 2 * shape.lm_head_params * len(prompt_lens)
        + attention_flops(shape, sum(n * (n + 1) // 2 for n in prompt_lens)),
    )
    seconds = rates.floor_seconds(prefill)
    for step in range(1, max(output_lens)):
        contexts = [p + step for p, n in zip(prompt_lens, output_lens, strict=True) if n > step]
        seconds += rates.floor_seconds(decode_step_work(shape, contexts, widths))
    return seconds


def shared_prefix_floor_seconds(
    shape: ModelShape,
    prefix_len: int,
    num_prefixes: int,
    suffix_lens: list[int],
    output_lens: list[int],
    chunk_size: int,
    widths: ByteWidths,
    rates: DeviceRates,
) -> float:
    """`workload_floor_seconds` for requests that each start with one of `num_prefixes` shared
    prefixes of `prefix_len` tokens, then `suffix_lens[i]` tokens of their own: each prefix is
    prefilled once (the prefix cache) and every decode step reads each prefix's K/V once (the
    cascade), beside each request's own K/V; every request's queries still attend over its prefix."""
    prefill_lens = [prefix_len] * num_prefixes + list(suffix_lens)
    seconds = workload_floor_seconds(shape, prefill_lens, [1] * len(prefill_lens), chunk_size, widths, rates)
    shared_kv = kv_bytes(shape, num_prefixes * prefix_len, widths)
    for step in range(1, max(output_lens)):
        own = [s + step for s, n in zip(suffix_lens, output_lens, strict=True) if n > step]
        work = decode_step_work(shape, own, widths)
        seconds += rates.floor_seconds(
            Work(work.bytes_read + shared_kv, work.flops + attention_flops(shape, len(own) * prefix_len))
        )
    return seconds


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_seconds(device: torch.device, fn, iters: int) -> float:
    """Fastest of `iters` timed calls after one warm-up call."""
    fn()
    _synchronize(device)
    best = float("inf")
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        _synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best


def measure_copy_bandwidth(device: torch.device, num_bytes: int, iters: int = 10) -> float:
    """Bytes read plus bytes written per second by a device-to-device copy of `num_bytes`."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    seconds = _best_seconds(device, lambda: dst.copy_(src), iters)
    return 2 * num_bytes / seconds


def measure_matmul_rate(device: torch.device, dtype: torch.dtype, n: int, iters: int = 10) -> float:
    """FLOP/s of an n x n x n matmul in `dtype`."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    seconds = _best_seconds(device, lambda: torch.matmul(a, b, out=out), iters)
    return 2 * n**3 / seconds


def measure_device_rates(device: torch.device, dtype: torch.dtype) -> DeviceRates:
    """Sized for a datacenter GPU (1 GiB copy, 8192^3 matmul); sized down on the CPU."""
    if device.type == "cuda":
        return DeviceRates(measure_copy_bandwidth(device, 1 << 30), measure_matmul_rate(device, dtype, 8192))
    return DeviceRates(measure_copy_bandwidth(device, 64 << 20, 5), measure_matmul_rate(device, dtype, 512, 5))
