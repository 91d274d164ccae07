"""The batched sampler: greedy rows, exact truncation supports, the sampled distribution,
seeded reproducibility independent of the batch, the counter-based hash, and the Triton kernel."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from sampling_utils import chi_square_critical_value, make_metadata

from pagoda.sample.ops import (
    SPLITMIX64_GAMMA,
    SPLITMIX64_MULTIPLIERS,
    SPLITMIX64_SHIFTS,
    gumbel_max_torch,
    hashed_uniforms,
    inverse_temperature,
    splitmix64_,
    truncation_cutoff,
)
from pagoda.sample.sampler import LOGPROBS_MODES, Sampler

UINT64 = (1 << 64) - 1


def repeated_draws(logits_row: torch.Tensor, num_draws: int, seed: int = 1234, **settings: float) -> torch.Tensor:
    """Tokens for one request's settings at output positions 0..num_draws-1, sampled as one batch."""
    metadata = make_metadata(
        temperature=[settings.get("temperature", 1.0)] * num_draws,
        seeds=[seed] * num_draws,
        output_positions=list(range(num_draws)),
        top_k=[settings["top_k"]] * num_draws if "top_k" in settings else None,
        top_p=[settings["top_p"]] * num_draws if "top_p" in settings else None,
        min_p=[settings["min_p"]] * num_draws if "min_p" in settings else None,
        device=str(logits_row.device),
    )
    return Sampler()(logits_row.expand(num_draws, -1), metadata).sampled_token_ids


def reference_distribution(
    logits_row: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0
) -> dict[int, float]:
    """The truncated, renormalized distribution {token: probability}, straight from the definitions."""
    probs = torch.softmax(logits_row.double().cpu() / temperature, dim=-1)
    order = probs.argsort(descending=True).tolist()
    if 0 < top_k < len(order):
        order = order[:top_k]
    if top_p < 1.0:
        total = sum(probs[t].item() for t in order)
        kept, cumulative = [], 0.0
        for token in order:
            kept.append(token)
            cumulative += probs[token].item() / total
            if cumulative >= top_p:
                break
        order = kept
    largest = probs.max().item()
    order = [t for t in order if probs[t].item() >= min_p * largest]
    total = sum(probs[t].item() for t in order)
    return {t: probs[t].item() / total for t in order}


def splitmix64_reference(value: int) -> int:
    z = value & UINT64
    z = ((z ^ (z >> SPLITMIX64_SHIFTS[0])) * SPLITMIX64_MULTIPLIERS[0]) & UINT64
    z = ((z ^ (z >> SPLITMIX64_SHIFTS[1])) * SPLITMIX64_MULTIPLIERS[1]) & UINT64
    return z ^ (z >> SPLITMIX64_SHIFTS[2])


def as_signed64(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


# --- greedy -------------------------------------------------------------------------------


def test_all_greedy_batch_is_argmax(device: str) -> None:
    logits = torch.randn(37, 1000, device=device)
    metadata = make_metadata([0.0] * 37, list(range(37)), [5] * 37, top_k=[3] * 37, device=device)
    assert torch.equal(Sampler()(logits, metadata).sampled_token_ids, logits.argmax(dim=-1))


def test_greedy_rows_of_a_mixed_batch_get_their_argmax(device: str) -> None:
    num_rows = 64
    # Flat logits: a random row almost never lands on the argmax, so a leak of noise would show.
    logits = torch.randn(num_rows, 500, device=device) * 0.01
    temperature = [0.0 if row % 3 == 0 else 1.0 for row in range(num_rows)]
    metadata = make_metadata(
        temperature,
        seeds=list(range(num_rows)),
        output_positions=[7] * num_rows,
        top_k=[0 if row % 2 else 50 for row in range(num_rows)],
        top_p=[0.9] * num_rows,
        min_p=[0.01] * num_rows,
        device=device,
    )
    sampled = Sampler()(logits, metadata).sampled_token_ids
    greedy = torch.tensor([t == 0.0 for t in temperature], device=device)
    argmax = logits.argmax(dim=-1)
    assert torch.equal(sampled[greedy], argmax[greedy])
    assert (sampled[~greedy] != argmax[~greedy]).float().mean() > 0.8
    assert sampled.dtype == torch.int64 and sampled.device == logits.device


def test_bfloat16_logits_are_sampled_as_their_float32_values() -> None:
    logits = torch.randn(48, 300).to(torch.bfloat16)
    settings = dict(seeds=list(range(48)), output_positions=[3] * 48, top_k=[20] * 48, top_p=[0.8] * 48)
    metadata = make_metadata([0.0] * 8 + [0.9] * 40, **settings)
    sampler = Sampler()
    assert torch.equal(sampler(logits, metadata).sampled_token_ids, sampler(logits.float(), metadata).sampled_token_ids)


# --- truncation supports ----------------------------------------------------------------------

TRUNCATIONS = [
    dict(top_k=4),
    dict(top_p=0.7),
    dict(min_p=0.2),
    dict(temperature=0.6, top_k=6, top_p=0.8),
    dict(temperature=1.7, top_p=0.6, min_p=0.3),
    dict(temperature=1.3, top_k=9, top_p=0.9, min_p=0.1),
]


@pytest.mark.parametrize("settings", TRUNCATIONS, ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()))
def test_sampled_tokens_cover_exactly_the_truncated_support(device: str, settings: dict) -> None:
    num_draws = 4000
    logits_row = torch.randn(24, generator=torch.Generator().manual_seed(11)).to(device) * 1.5
    expected = reference_distribution(logits_row, **settings)
    assert 1 < len(expected) < 24, "the setting must actually truncate"
    assert min(expected.values()) * num_draws >= 30, "every support token must be likely to appear"

    sampled = set(repeated_draws(logits_row, num_draws, **settings).tolist())
    assert sampled == set(expected)


def test_cutoff_is_off_for_rows_whose_filters_are_off() -> None:
    logits = torch.randn(4, 100)
    temperature = torch.tensor([1.0, 0.5, 0.0, 2.0])
    cutoff = truncation_cutoff(
        logits,
        temperature,
        top_k=torch.tensor([0, -1, 100, 500], dtype=torch.int32),
        top_p=torch.ones(4),
        min_p=torch.zeros(4),
    )
    assert torch.equal(cutoff, (logits * inverse_temperature(temperature)[:, None]).amin(dim=-1))


def test_cutoff_keeps_at_least_the_top_token_when_top_p_is_tiny() -> None:
    logits = torch.randn(8, 100)
    cutoff = truncation_cutoff(logits, torch.ones(8), None, torch.full((8,), 1e-9), None)
    assert torch.equal(cutoff, logits.amax(dim=-1))


# --- the sampled distribution -----------------------------------------------------------------


@pytest.mark.parametrize(
    "settings", [dict(temperature=0.7), dict(temperature=1.3, top_k=10, top_p=0.95, min_p=0.02)], ids=["T", "all"]
)
def test_frequencies_match_the_truncated_softmax(device: str, settings: dict) -> None:
    num_draws = 20_000
    logits_row = torch.randn(12, generator=torch.Generator().manual_seed(5)).to(device)
    expected = reference_distribution(logits_row, **settings)
    assert min(expected.values()) * num_draws >= 5, "chi-square needs every expected count >= 5"

    counts = torch.bincount(repeated_draws(logits_row, num_draws, **settings).cpu(), minlength=12)
    assert sum(counts[t].item() for t in expected) == num_draws
    statistic = sum((counts[t].item() - num_draws * p) ** 2 / (num_draws * p) for t, p in expected.items())
    assert statistic < chi_square_critical_value(len(expected) - 1)


# --- seeds: reproducible, independent of the batch --------------------------------------------


def test_a_rows_token_depends_only_on_its_seed_position_and_logits(device: str) -> None:
    num_rows, vocab_size = 40, 2000
    logits = torch.randn(num_rows, vocab_size, device=device) * 2
    temperature = [0.5 + 0.05 * row for row in range(num_rows)]
    seeds = [1000 + row for row in range(num_rows)]
    positions = [3 * row for row in range(num_rows)]
    top_p = [1.0 if row % 2 else 0.9 for row in range(num_rows)]
    sampled = Sampler()(logits, make_metadata(temperature, seeds, positions, top_p=top_p, device=device))

    # Reverse the rows and add others (greedy ones, and filters the first batch did not use).
    extra = 25
    order = list(reversed(range(num_rows)))
    bigger_logits = torch.cat([logits[order], torch.randn(extra, vocab_size, device=device)])
    bigger = make_metadata(
        [temperature[r] for r in order] + [0.0] * 5 + [1.0] * (extra - 5),
        [seeds[r] for r in order] + list(range(extra)),
        [positions[r] for r in order] + [0] * extra,
        top_k=[0] * num_rows + [5] * extra,
        top_p=[top_p[r] for r in order] + [0.5] * extra,
        min_p=[0.0] * num_rows + [0.1] * extra,
        device=device,
    )
    resampled = Sampler()(bigger_logits, bigger).sampled_token_ids[:num_rows]
    assert torch.equal(resampled, sampled.sampled_token_ids[order])


def test_other_seeds_or_positions_give_other_draws(device: str) -> None:
    num_draws = 2000
    logits_row = torch.zeros(16, device=device)  # uniform: two independent streams agree 1/16 of the time
    base = repeated_draws(logits_row, num_draws, seed=7)
    other_seed = repeated_draws(logits_row, num_draws, seed=8)
    shifted = repeated_draws(logits_row, num_draws + 1, seed=7)[1:]
    assert torch.equal(base, repeated_draws(logits_row, num_draws, seed=7))
    assert (base == other_seed).float().mean() < 0.1
    assert (base == shifted).float().mean() < 0.1


# --- the counter-based hash ---------------------------------------------------------------------


def test_splitmix64_matches_unsigned_64_bit_arithmetic() -> None:
    values = [0, 1, -1, 2**63 - 1, -(2**63), 0x0123456789ABCDEF, -0x0123456789ABCDEF]
    values += torch.randint(-(2**63), 2**63 - 1, (200,), dtype=torch.int64).tolist()
    mixed = splitmix64_(torch.tensor(values, dtype=torch.int64))
    assert mixed.tolist() == [as_signed64(splitmix64_reference(v)) for v in values]


def test_uniforms_follow_the_documented_hash() -> None:
    seeds, positions = [3, -5, 2**40], [0, 17, 123456]
    uniforms = hashed_uniforms(torch.tensor(seeds), torch.tensor(positions), 8)
    for row, (seed, position) in enumerate(zip(seeds, positions, strict=True)):
        key = splitmix64_reference(splitmix64_reference(seed) + position * SPLITMIX64_GAMMA)
        for token in range(8):
            top_bits = splitmix64_reference(key + token * SPLITMIX64_GAMMA) >> 32
            expected = min((top_bits + 0.5) / 2**32, 1 - 2**-24)
            assert uniforms[row, token].item() == pytest.approx(expected, rel=1e-7)


def test_uniforms_are_inside_the_open_interval_and_look_independent() -> None:
    num_positions, vocab_size = 1000, 1000
    seeds = torch.full((num_positions,), 99)
    uniforms = hashed_uniforms(seeds, torch.arange(num_positions), vocab_size).double()
    assert uniforms.min() > 0 and uniforms.max() < 1
    assert abs(uniforms.mean().item() - 0.5) < 0.002
    assert abs(uniforms.var().item() - 1 / 12) < 0.001
    # Every row and every column uniform on its own (standard error of a mean of 1000: 0.009).
    assert (uniforms.mean(dim=0) - 0.5).abs().max() < 0.05
    assert (uniforms.mean(dim=1) - 0.5).abs().max() < 0.05
    # No correlation between neighbouring positions, neighbouring tokens, or nearby seeds.
    centred = uniforms - 0.5
    assert abs((centred[1:] * centred[:-1]).mean().item()) * 12 < 0.01
    assert abs((centred[:, 1:] * centred[:, :-1]).mean().item()) * 12 < 0.01
    next_seed = hashed_uniforms(seeds + 1, torch.arange(num_positions), vocab_size).double() - 0.5
    assert abs((centred * next_seed).mean().item()) * 12 < 0.01
    # Neighbouring positions share only the values float32 rounding makes equal (two uniforms are
    # the same float32 with probability about 1 / (3 * 2**23): ~40 of these 1e9 pairs); overlapping
    # streams, rows that are shifted copies of one another, would share about 1e6.
    shared = sum(torch.isin(uniforms[p + 1], uniforms[p]).sum().item() for p in range(num_positions - 1))
    assert shared < 200


# --- API --------------------------------------------------------------------------------------------


def test_logprobs_mode_is_validated_and_kept() -> None:
    for mode in LOGPROBS_MODES:
        assert Sampler(mode).logprobs_mode == mode
    with pytest.raises(ValueError, match="logprobs_mode"):
        Sampler("logits")


# --- the Triton kernel ------------------------------------------------------------------------------


def triton_case(device: str, num_rows: int, vocab_size: int) -> tuple[torch.Tensor, ...]:
    """Logits, inverse temperatures, seeds, positions and a cutoff mixing all three filters."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(num_rows, vocab_size, generator=generator) * 3
    logits[:, -vocab_size // 5 :] += 4  # winners in the last, partial block too
    temperature = torch.rand(num_rows, generator=generator) * 1.5 + 0.1
    temperature[::8] = 0.0  # greedy rows
    seeds = torch.randint(-(2**62), 2**62, (num_rows,), generator=generator)
    positions = torch.randint(0, 10**6, (num_rows,), generator=generator)
    top_k = torch.randint(0, 200, (num_rows,), generator=generator, dtype=torch.int32)
    top_k[1::4] = 1  # the cutoff is the top token's own scaled logit: the kernel must keep it
    top_p = torch.rand(num_rows, generator=generator)
    min_p = torch.rand(num_rows, generator=generator) * 0.1
    inputs = [t.to(device) for t in (logits, temperature, seeds, positions, top_k, top_p, min_p)]
    return (*inputs[:4], truncation_cutoff(inputs[0], inputs[1], *inputs[4:]))


def assert_same_draws_up_to_near_ties(
    inputs: tuple[torch.Tensor, ...], tokens: torch.Tensor, cutoff_used: bool
) -> None:
    """Tokens equal the torch path's, except where its two perturbed scores tie to within rounding."""
    logits, temperature, seeds, positions, cutoff = inputs
    cutoff = cutoff if cutoff_used else None
    expected = gumbel_max_torch(logits, temperature, seeds, positions, cutoff)
    greedy = temperature == 0.0
    assert torch.equal(tokens[greedy], logits[greedy].argmax(dim=-1))
    scaled = logits.float() * inverse_temperature(temperature)[:, None]
    scores = scaled - hashed_uniforms(seeds, positions, logits.shape[-1]).neg().log1p().neg().log()
    scores[greedy] = scaled[greedy]
    if cutoff is not None:
        scores[scaled < cutoff[:, None]] = float("-inf")
    rows = torch.arange(len(tokens), device=tokens.device)
    gap = (scores[rows, expected] - scores[rows, tokens]).abs()
    assert (tokens == expected).float().mean() > 0.99
    assert gap.max() < 1e-4 * (1 + scores[rows, expected].abs().max())


def test_triton_kernel_matches_the_torch_path_under_the_interpreter(tmp_path) -> None:
    pytest.importorskip("triton")
    script = textwrap.dedent(
        f"""
        import sys, torch
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        sys.path.insert(0, {os.path.dirname(os.path.dirname(__file__))!r})  # sampling_utils
        from test_sampler import triton_case
        from pagoda.sample.ops import gumbel_max_triton
        inputs = triton_case("cpu", 32, 4500)
        tokens = [gumbel_max_triton(*inputs[:4], cutoff) for cutoff in (None, inputs[4])]
        torch.save(tokens, {str(tmp_path / "tokens.pt")!r})
        """
    )
    subprocess.run([sys.executable, "-c", script], env={**os.environ, "TRITON_INTERPRET": "1"}, check=True, timeout=120)
    inputs = triton_case("cpu", 32, 4500)
    for tokens, cutoff_used in zip(torch.load(tmp_path / "tokens.pt"), (False, True), strict=True):
        assert_same_draws_up_to_near_ties(inputs, tokens, cutoff_used)


@pytest.mark.gpu
def test_triton_kernel_matches_the_torch_path_on_the_gpu() -> None:
    from pagoda.sample.ops import gumbel_max_triton

    inputs = triton_case("cuda", 256, 151_936)
    for cutoff_used in (False, True):
        tokens = gumbel_max_triton(*inputs[:4], inputs[4] if cutoff_used else None)
        assert_same_draws_up_to_near_ties(inputs, tokens, cutoff_used)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_truncation_cutoff_of_a_row_does_not_depend_on_its_batch(device: str) -> None:
    """Top-k + top-p cutoffs, bit for bit, for each row alone and in batches of 2 to 64 (a lone
    CUDA row's cumulative sum is scanned as a batch's rows are)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    generator = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(64, 151_936, generator=generator)).to(device)
    temperature = torch.full((64,), 0.9, device=device)
    top_k = torch.full((64,), 5000, device=device)
    top_p = torch.full((64,), 0.9, device=device)

    def cutoffs(rows: slice) -> torch.Tensor:
        return truncation_cutoff(logits[rows], temperature[rows], top_k[rows], top_p[rows], None)

    alone = torch.cat([cutoffs(slice(i, i + 1)) for i in range(4)])
    for size in (2, 8, 64):
        batched = cutoffs(slice(0, size))
        assert torch.equal(batched[: len(alone)], alone[:size]), size
