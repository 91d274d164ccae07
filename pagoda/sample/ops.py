"""Batched sampling math: counter-based random draws, truncation cutoffs and Gumbel-max.

Every random draw is a pure function of (seed, output position, vocab index): a splitmix64
stream per request, advanced by the output position, whose value keys a second splitmix64
stream over the vocabulary. A row's token therefore never depends on its neighbours, its row
index or the batch size, and there is no generator state to keep, restore or replay.

Two implementations of the Gumbel-max draw compute the same function: plain torch ops (any
device, the reference) and one fused Triton kernel for CUDA that reads the logits once and
writes no [B, V] temporary. Their noise differs only by the rounding of their logarithms, so
their tokens differ only where two perturbed scores tie to within about 1e-6.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # triton is optional off the GPU; the torch path runs everywhere
    triton = None


def _as_signed64(value: int) -> int:
    """The int64 with the same bits as an unsigned 64-bit constant (torch has no uint64 math)."""
    return value - (1 << 64) if value >= 1 << 63 else value


SPLITMIX64_GAMMA = 0x9E3779B97F4A7C15
SPLITMIX64_MULTIPLIERS = (0xBF58476D1CE4E5B9, 0x94D049BB133111EB)
SPLITMIX64_SHIFTS = (30, 27, 31)
# Below this a temperature means argmax (the same threshold as SamplingParams.greedy).
GREEDY_TEMPERATURE = 1e-5
# Largest float32 below 1: float32 rounding of a 32-bit count near 2**32 would otherwise give u == 1.
_LARGEST_FLOAT32_BELOW_ONE = 1.0 - 2.0**-24
_TRITON_BLOCK_SIZE = 4096


def _logical_xorshift_(x: torch.Tensor, shift: int) -> torch.Tensor:
    """x ^= x >>> shift, in place. torch shifts int64 arithmetically; the mask clears the sign fill."""
    return x.bitwise_xor_((x >> shift).bitwise_and_((1 << (64 - shift)) - 1))


def splitmix64_(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer on an int64 tensor, in place: bit for bit the unsigned 64-bit function.

    Multiplication wraps modulo 2**64 in two's complement on every torch backend, which is all
    the unsigned arithmetic needs; the tests pin the bits against Python integers.
    """
    _logical_xorshift_(x, SPLITMIX64_SHIFTS[0]).mul_(_as_signed64(SPLITMIX64_MULTIPLIERS[0]))
    _logical_xorshift_(x, SPLITMIX64_SHIFTS[1]).mul_(_as_signed64(SPLITMIX64_MULTIPLIERS[1]))
    return _logical_xorshift_(x, SPLITMIX64_SHIFTS[2])


def row_keys(seeds: torch.Tensor, output_positions: torch.Tensor) -> torch.Tensor:
    """[B] int64: the output_position-th value of a splitmix64 stream started from each seed."""
    state = splitmix64_(seeds.to(torch.int64, copy=True))
    state += output_positions.to(torch.int64) * _as_signed64(SPLITMIX64_GAMMA)
    return splitmix64_(state)


def hashed_uniforms(seeds: torch.Tensor, output_positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, V] float32 uniforms strictly inside (0, 1), one per (row, token).

    Each is the top 32 bits of the token's splitmix64 value, shifted half a step off zero; the
    resolution near 0 is what sets the Gumbel noise's upper tail (see `gumbel_max_torch`).
    """
    keys = row_keys(seeds, output_positions)
    offsets = torch.arange(vocab_size, device=keys.device, dtype=torch.int64) * _as_signed64(SPLITMIX64_GAMMA)
    bits = splitmix64_(keys[:, None] + offsets)
    top_bits = bits.bitwise_right_shift_(32).bitwise_and_(0xFFFFFFFF)
    return top_bits.to(torch.float32).mul_(2.0**-32).add_(2.0**-33).clamp_(max=_LARGEST_FLOAT32_BELOW_ONE)


def inverse_temperature(temperature: torch.Tensor) -> torch.Tensor:
    """[B] float32 factor on the logits: 1 / T, and 1 for greedy rows (so their scaled logits are the raw ones).

    Multiplying by it is exact IEEE arithmetic in torch and Triton alike, so a cutoff computed here
    compares bit for bit with the kernel's scaled logits (the cutoff token itself is always kept).
    """
    return 1.0 / torch.where(temperature < GREEDY_TEMPERATURE, 1.0, temperature.float())


def truncation_cutoff(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
) -> torch.Tensor | None:
    """[B] float32 threshold on the scaled logits (logits * inverse_temperature): tokens below it are dropped.

    None when no row truncates. Tokens tied with the cutoff token are kept. Top-k and top-p
    share one descending sort; min-p needs none, since p_i >= min_p * p_max is the same as
    scaled logit_i >= max scaled logit + log(min_p) (and min_p = 0 gives -inf: keep all).
    Min-p compares probabilities with the largest one, a ratio the other two filters leave
    unchanged, so applying it last or first keeps the same tokens.
    """
    if top_k is None and top_p is None and min_p is None:
        return None
    cutoff = None
    scale = inverse_temperature(temperature)
    if top_k is not None or top_p is not None:
        cutoff = _sorted_cutoff(logits, scale, top_k, top_p)
    if min_p is not None:
        min_p_cutoff = logits.amax(dim=-1).float() * scale + min_p.log()
        cutoff = min_p_cutoff if cutoff is None else torch.maximum(cutoff, min_p_cutoff)
    return cutoff


def _sorted_cutoff(
    logits: torch.Tensor,
    scale: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
) -> torch.Tensor:
    """The scaled logit of the last token kept by top-k then top-p (top-p on the renormalized top-k set)."""
    vocab_size = logits.shape[-1]
    # Scaling by a positive factor keeps the order, so sort first and scale the sorted copy in place.
    scaled = logits.sort(dim=-1, descending=True).values.float().mul_(scale[:, None])
    keep = torch.full_like(scale, vocab_size, dtype=torch.int64)
    if top_k is not None:
        keep = torch.where((top_k > 0) & (top_k < vocab_size), top_k.to(torch.int64), keep)
    if top_p is not None:
        cumulative = _row_cumsum(scaled.softmax(dim=-1))
        top_k_mass = cumulative.gather(1, keep[:, None] - 1)
        # The token whose cumulative probability first reaches p is kept: count those below p, plus one.
        reaching_p = (cumulative < top_p[:, None] * top_k_mass).sum(dim=-1) + 1
        # At most k already, unless a parallel cumsum wobbles by a rounding step past the top-k mass.
        keep = torch.where(top_p < 1.0, torch.minimum(keep, reaching_p), keep)
    return scaled.gather(1, keep[:, None] - 1).squeeze(1)


def _row_cumsum(probs: torch.Tensor) -> torch.Tensor:
    """Cumulative sums along each row of [B, V], each row summed in the same order at every B.

    CUDA torch scans a lone row (numel == V) with a different kernel than a batch of rows, so a
    single row is scanned beside a copy of itself."""
    if probs.is_cuda and probs.shape[0] == 1:
        return probs.expand(2, -1).cumsum(dim=-1)[:1]
    return probs.cumsum_(dim=-1)


def gumbel_max(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    output_positions: torch.Tensor,
    cutoff: torch.Tensor | None,
) -> torch.Tensor:
    """[B] int64: per row, a draw from softmax(logits / T) over the tokens at or above the cutoff.

    Greedy rows (T below GREEDY_TEMPERATURE) take the argmax of the raw logits instead. The fused
    Triton kernel runs on CUDA, the torch ops elsewhere (the module docstring says how closely
    they agree).
    """
    if logits.is_cuda and triton is not None:
        return gumbel_max_triton(logits, temperature, seeds, output_positions, cutoff)
    return gumbel_max_torch(logits, temperature, seeds, output_positions, cutoff)


def gumbel_max_torch(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    output_positions: torch.Tensor,
    cutoff: torch.Tensor | None,
) -> torch.Tensor:
    """argmax(scaled logits + g) over the kept tokens, with Gumbel noise g = -log(-log(1 - u)).

    1 - u is as uniform as u; taking the noise from u through log1p keeps the 32-bit resolution
    of u near 0 in the noise's upper tail, the end that decides the argmax.
    """
    scaled = logits.float() * inverse_temperature(temperature)[:, None]
    log_exponential = hashed_uniforms(seeds, output_positions, logits.shape[-1]).neg_().log1p_().neg_().log_()
    log_exponential.masked_fill_((temperature < GREEDY_TEMPERATURE)[:, None], 0.0)
    perturbed = torch.sub(scaled, log_exponential, out=log_exponential)
    if cutoff is not None:
        perturbed.masked_fill_(scaled < cutoff[:, None], float("-inf"))
    return perturbed.argmax(dim=-1)


def gumbel_max_triton(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    output_positions: torch.Tensor,
    cutoff: torch.Tensor | None,
) -> torch.Tensor:
    """`gumbel_max_torch` fused into one pass: each program reduces one vocab block of one row."""
    num_rows, vocab_size = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    num_blocks = triton.cdiv(vocab_size, _TRITON_BLOCK_SIZE)
    block_max = torch.empty((num_rows, num_blocks), dtype=torch.float32, device=logits.device)
    block_argmax = torch.empty((num_rows, num_blocks), dtype=torch.int64, device=logits.device)
    _gumbel_max_kernel[(num_rows, num_blocks)](
        logits,
        logits.stride(0),
        temperature,
        seeds,
        output_positions,
        temperature if cutoff is None else cutoff,
        block_max,
        block_argmax,
        vocab_size,
        num_blocks,
        HAS_CUTOFF=cutoff is not None,
        BLOCK_SIZE=_TRITON_BLOCK_SIZE,
        num_warps=8,
    )
    return block_argmax.gather(1, block_max.argmax(dim=-1, keepdim=True)).squeeze(1)


if triton is not None:
    _GAMMA: tl.constexpr = tl.constexpr(SPLITMIX64_GAMMA)
    _MULTIPLIER_1: tl.constexpr = tl.constexpr(SPLITMIX64_MULTIPLIERS[0])
    _MULTIPLIER_2: tl.constexpr = tl.constexpr(SPLITMIX64_MULTIPLIERS[1])
    _SHIFT_1: tl.constexpr = tl.constexpr(SPLITMIX64_SHIFTS[0])
    _SHIFT_2: tl.constexpr = tl.constexpr(SPLITMIX64_SHIFTS[1])
    _SHIFT_3: tl.constexpr = tl.constexpr(SPLITMIX64_SHIFTS[2])
    _GREEDY_TEMPERATURE: tl.constexpr = tl.constexpr(GREEDY_TEMPERATURE)
    _BELOW_ONE: tl.constexpr = tl.constexpr(_LARGEST_FLOAT32_BELOW_ONE)
    _TWO_TO_MINUS_32: tl.constexpr = tl.constexpr(2.0**-32)
    _TWO_TO_MINUS_33: tl.constexpr = tl.constexpr(2.0**-33)

    @triton.jit
    def _splitmix64(z):
        z = (z ^ (z >> _SHIFT_1)) * _MULTIPLIER_1
        z = (z ^ (z >> _SHIFT_2)) * _MULTIPLIER_2
        return z ^ (z >> _SHIFT_3)

    @triton.jit
    def _standard_exponential(u):
        """-log(1 - u) to full relative precision for small u, where the noise's upper tail comes from.

        A short series below 1/16 stands in for log1p, which the Triton interpreter lacks.
        """
        series = u * (1.0 + u * (0.5 + u * (0.3333333333333333 + u * (0.25 + u * (0.2 + u * 0.16666666666666666)))))
        return tl.where(u < 0.0625, series, -tl.log(1.0 - u))

    @triton.jit
    def _gumbel_max_kernel(
        logits_ptr,
        logits_row_stride,
        temperature_ptr,
        seeds_ptr,
        output_positions_ptr,
        cutoff_ptr,
        block_max_ptr,
        block_argmax_ptr,
        vocab_size,
        num_blocks,
        HAS_CUTOFF: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
    ):
        row = tl.program_id(0)
        block = tl.program_id(1)
        cols = block * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
        in_vocab = cols < vocab_size
        logits = tl.load(logits_ptr + row.to(tl.int64) * logits_row_stride + cols, mask=in_vocab, other=float("-inf"))
        temperature = tl.load(temperature_ptr + row)
        greedy = temperature < _GREEDY_TEMPERATURE
        # div_rn: the correctly rounded 1 / T that `inverse_temperature` computes in torch.
        scaled = logits.to(tl.float32) * tl.math.div_rn(1.0, tl.where(greedy, 1.0, temperature))

        if greedy:
            perturbed = scaled
        else:
            seed = tl.load(seeds_ptr + row).to(tl.uint64, bitcast=True)
            position = tl.load(output_positions_ptr + row).to(tl.uint64, bitcast=True)
            key = _splitmix64(_splitmix64(seed) + position * _GAMMA)
            top_bits = (_splitmix64(key + cols.to(tl.uint64) * _GAMMA) >> 32).to(tl.uint32)
            u = tl.minimum(top_bits.to(tl.float32) * _TWO_TO_MINUS_32 + _TWO_TO_MINUS_33, _BELOW_ONE)
            perturbed = scaled - tl.log(_standard_exponential(u))
        if HAS_CUTOFF:
            perturbed = tl.where(scaled >= tl.load(cutoff_ptr + row), perturbed, float("-inf"))
        best, best_col = tl.max(perturbed, axis=0, return_indices=True, return_indices_tie_break_left=True)
        tl.store(block_max_ptr + row * num_blocks + block, best)
        tl.store(block_argmax_ptr + row * num_blocks + block, block * BLOCK_SIZE + best_col)
