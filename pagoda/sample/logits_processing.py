"""Logits processing before temperature and truncation: an ordered chain of processors (logit
bias, penalties, bans, allowed tokens, grammar masks).

Each pass runs over the whole step at once and only when some row of the step needs it (the
metadata field is None otherwise). Rows that do not use a pass hold neutral values, which
leave their logits bit for bit unchanged, so a request gets the same tokens in any batch.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from pagoda.sample import triton_bitmask
from pagoda.sample.metadata import PenaltyMetadata, SamplingMetadata, TokenBitmask, TokenEntries


class LogitsProcessor(ABC):
    """One pass of the chain: `applies` says (from the step's metadata alone, no device work)
    whether any row of the step uses it; `apply` changes those rows' logits in place.
    `only_masks`: the pass only sets logits to -inf, which is exact in any float dtype."""

    only_masks = False

    @abstractmethod
    def applies(self, metadata: SamplingMetadata) -> bool: ...

    @abstractmethod
    def apply(self, logits: torch.Tensor, metadata: SamplingMetadata) -> None: ...


class LogitBias(LogitsProcessor):
    def applies(self, metadata: SamplingMetadata) -> bool:
        return metadata.logit_bias is not None

    def apply(self, logits: torch.Tensor, metadata: SamplingMetadata) -> None:
        bias = metadata.logit_bias
        assert bias is not None and bias.values is not None
        logits.index_put_((bias.rows, bias.token_ids), bias.values, accumulate=True)


class Penalties(LogitsProcessor):
    def applies(self, metadata: SamplingMetadata) -> bool:
        return metadata.penalties is not None

    def apply(self, logits: torch.Tensor, metadata: SamplingMetadata) -> None:
        assert metadata.penalties is not None
        apply_penalties(logits, metadata.penalties)


class TokenBans(LogitsProcessor):
    """min_tokens' hidden stop tokens and matched bad words."""

    only_masks = True

    def applies(self, metadata: SamplingMetadata) -> bool:
        return metadata.banned_token_ids is not None

    def apply(self, logits: torch.Tensor, metadata: SamplingMetadata) -> None:
        banned = metadata.banned_token_ids
        assert banned is not None
        minus_inf = torch.full(banned.rows.shape, float("-inf"), device=logits.device, dtype=logits.dtype)
        logits.index_put_((banned.rows, banned.token_ids), minus_inf)


class AllowedTokens(LogitsProcessor):
    only_masks = True

    def applies(self, metadata: SamplingMetadata) -> bool:
        return metadata.allowed_token_ids is not None

    def apply(self, logits: torch.Tensor, metadata: SamplingMetadata) -> None:
        assert metadata.allowed_rows is not None and metadata.allowed_token_ids is not None
        apply_allowed_token_ids(logits, metadata.allowed_rows, metadata.allowed_token_ids)


class GrammarMask(LogitsProcessor):
    """Structured output: each constrained row keeps only the tokens its grammar allows next."""

    only_masks = True

    def applies(self, metadata: SamplingMetadata) -> bool:
        return metadata.grammar_bitmask is not None

    def apply(self, logits: torch.Tensor, metadata: SamplingMetadata) -> None:
        bitmask = metadata.grammar_bitmask
        assert bitmask is not None
        if bitmask.ready is not None:
            torch.cuda.current_stream(logits.device).wait_event(bitmask.ready)
        apply_token_bitmask(logits, bitmask)
        if bitmask.applied is not None:
            bitmask.applied.record(torch.cuda.current_stream(logits.device))


# The order matters: values change first (bias, penalties), then the masks, the allowed set and
# the grammar last, so no later pass can lift a ban or bring back a token either refused.
LOGITS_PROCESSORS: tuple[LogitsProcessor, ...] = (LogitBias(), Penalties(), TokenBans(), AllowedTokens(), GrammarMask())


def process_logits(
    logits: torch.Tensor, metadata: SamplingMetadata, chain: tuple[LogitsProcessor, ...] = LOGITS_PROCESSORS
) -> torch.Tensor:
    """A float32 copy of the logits with every pass of the chain the step uses applied, or the
    logits themselves when none is. Passes that only mask (bans, allowed tokens, the grammar)
    run on the logits in place, in their dtype, when no logprobs are asked: nothing reads the
    raw values then, and -inf is the same in any dtype (a grammar step at batch 256 and a
    150k vocabulary saves a [B, V] float32 copy).

    The bans never cover a row's whole allowed set (the runner's SamplingBatch drops those that
    would), so every row keeps a token it may pick; a grammar's mask is the request's own
    contract (the processor refuses settings that would hide the grammar's end).
    """
    active = [processor for processor in chain if processor.applies(metadata)]
    if not active:
        return logits
    in_place = metadata.max_num_logprobs is None and all(processor.only_masks for processor in active)
    processed = logits if in_place else logits.to(torch.float32, copy=True)
    for processor in active:
        processor.apply(processed, metadata)
    return processed


def apply_token_bitmask(logits: torch.Tensor, bitmask: TokenBitmask) -> None:
    """In place: row `bitmask.rows[i]` keeps token t only where bit t % 32 of word t // 32 of
    its words row is set (xgrammar's layout), tokens past its words refused; other rows are
    untouched. On CUDA one Triton kernel that writes only the refused logits; elsewhere torch ops."""
    if logits.is_cuda and triton_bitmask.available():
        triton_bitmask.apply_token_bitmask_triton(logits, bitmask.rows, bitmask.words, bitmask.word_rows)
        return
    num_rows, vocab_size = len(bitmask.rows), logits.shape[-1]
    words = bitmask.words if bitmask.word_rows is None else bitmask.words.index_select(0, bitmask.word_rows)
    words = words[:num_rows]
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    bits = (words[:, :, None] >> shifts).bitwise_and_(1).view(num_rows, -1)[:, :vocab_size]
    rows = logits.index_select(0, bitmask.rows)
    rows[:, : bits.shape[1]].masked_fill_(bits == 0, float("-inf"))
    rows[:, bits.shape[1] :] = float("-inf")
    logits.index_copy_(0, bitmask.rows, rows)


def apply_allowed_token_ids(logits: torch.Tensor, allowed_rows: torch.Tensor, allowed: TokenEntries) -> None:
    """In place: rows flagged in `allowed_rows` keep only their listed tokens; other rows are untouched."""
    disallowed = allowed_rows[:, None].expand_as(logits).clone()
    disallowed[allowed.rows, allowed.token_ids] = False
    logits.masked_fill_(disallowed, float("-inf"))


def apply_penalties(logits: torch.Tensor, penalties: PenaltyMetadata) -> None:
    """In place, with the definitions of HF / vLLM (repetition) and OpenAI (presence, frequency).

    Repetition: over tokens of the prompt or the output so far, a logit < 0 is multiplied by
    the penalty, any other divided by it. Then logit -= frequency * count + presence *
    (count > 0), with counts over the output only.
    """
    counts = penalties.output_token_counts
    generated = counts > 0
    if penalties.repetition_penalty is not None:
        assert penalties.prompt_token_mask is not None
        penalty = penalties.repetition_penalty[:, None]
        penalized = torch.where(logits < 0, logits * penalty, logits / penalty)
        torch.where(generated.logical_or(penalties.prompt_token_mask), penalized, logits, out=logits)
    if penalties.frequency_penalty is not None:
        logits.sub_(counts * penalties.frequency_penalty[:, None])
    if penalties.presence_penalty is not None:
        logits.sub_(generated * penalties.presence_penalty[:, None])
