"""The per-row sampling settings the model runner hands the sampler each step."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TokenEntries:
    """Sparse (row, token) entries of the step's logits, e.g. a logit bias: flat device tensors."""

    rows: torch.Tensor  # [E] int64, index into the step's sampled rows
    token_ids: torch.Tensor  # [E] int64
    values: torch.Tensor | None = None  # [E] float32, for settings that carry a value


@dataclass
class TokenBitmask:
    """Grammar masks of the step's constrained rows: bit t % 32 of word t // 32 set = token t allowed.

    The words may still be on their way to the device on a side stream when the sampler is
    queued: the pass waits for `ready` on its own stream, and records `applied` once it has
    read them (the next step's copy into the same buffer waits for that)."""

    rows: torch.Tensor  # [R] int64, index into the step's sampled rows
    words: torch.Tensor  # [M, W] int32, W <= ceil(V / 32): tokens from 32 W on are refused
    word_rows: torch.Tensor | None = None  # [R] int64: each entry's row of `words`; None: entry i's is i
    ready: torch.cuda.Event | None = None
    applied: torch.cuda.Event | None = None


@dataclass
class PenaltyMetadata:
    """Penalty settings of the step's rows and the token statistics they apply to.

    Neutral values (0, 0, 1) leave a row's logits bit for bit unchanged, so rows with and
    without penalties share one pass. A sub-pass is None when no row of the step needs it.
    """

    output_token_counts: torch.Tensor  # [B, V] int32: how often each token was generated
    prompt_token_mask: torch.Tensor | None  # [B, V] bool: tokens in the prompt (repetition only)
    presence_penalty: torch.Tensor | None  # [B] float32
    frequency_penalty: torch.Tensor | None  # [B] float32
    repetition_penalty: torch.Tensor | None  # [B] float32


@dataclass
class SamplingMetadata:
    """Device tensors, one entry per sampled row, mirrored from the persistent input batch.

    The optional settings are None when no row of the step uses them, so the sampler can skip
    their work (the sort above all) without looking at the values.
    """

    temperature: torch.Tensor  # [B] float32; below 1e-5 means a greedy row
    all_greedy: bool
    all_random: bool
    top_k: torch.Tensor | None  # [B] int32; <= 0 or >= vocab size means off
    top_p: torch.Tensor | None  # [B] float32; 1.0 means off
    min_p: torch.Tensor | None  # [B] float32; 0.0 means off
    seeds: torch.Tensor  # [B] int64; the runner draws one for unseeded requests
    output_positions: torch.Tensor  # [B] int64; index in the request's output of the token being sampled
    # Logits processing, in the order applied (see SamplingParams).
    logit_bias: TokenEntries | None = None
    penalties: PenaltyMetadata | None = None
    banned_token_ids: TokenEntries | None = None  # bad words matched this step, stop tokens under min_tokens
    allowed_token_ids: TokenEntries | None = None  # rows listed here may only pick their listed tokens
    allowed_rows: torch.Tensor | None = None  # [B] bool: the rows restricted by allowed_token_ids
    # Structured output: set by the runner once the constrained rows' grammars have the last token.
    grammar_bitmask: TokenBitmask | None = None
    # Top-N logprobs to return (the most any row asked for); None when no row asked.
    max_num_logprobs: int | None = None

    @property
    def processes_logits(self) -> bool:
        """True when any pass changes logit values before temperature and truncation."""
        return any(
            setting is not None
            for setting in (
                self.allowed_token_ids,
                self.banned_token_ids,
                self.logit_bias,
                self.penalties,
                self.grammar_bitmask,
            )
        )
