"""Logits processing before temperature and truncation: logit bias, penalties, bans, allowed tokens.

Each pass runs over the whole step at once and only when some row of the step needs it (the
metadata field is None otherwise). Rows that do not use a pass hold neutral values, which
leave their logits bit for bit unchanged, so a request gets the same tokens in any batch.
"""

from __future__ import annotations

import torch

from pagoda.sample.metadata import PenaltyMetadata, SamplingMetadata, TokenEntries


def process_logits(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """A float32 copy of the logits with every pass the step needs applied, or the logits
    themselves when none is needed (they are never modified: raw logprobs read them).

    The passes that change values (logit bias, penalties) come first and the masks last, the
    allowed set the very last: no later pass can lift a ban or bring back a token outside the
    allowed set. The bans never cover a row's whole allowed set (the runner's SamplingBatch
    drops those that would), so every row keeps a token it may pick.
    """
    if not metadata.processes_logits:
        return logits
    processed = logits.to(torch.float32, copy=True)
    if metadata.logit_bias is not None:
        bias = metadata.logit_bias
        assert bias.values is not None
        processed.index_put_((bias.rows, bias.token_ids), bias.values, accumulate=True)
    if metadata.penalties is not None:
        apply_penalties(processed, metadata.penalties)
    if metadata.banned_token_ids is not None:
        banned = metadata.banned_token_ids
        minus_inf = torch.full(banned.rows.shape, float("-inf"), device=processed.device)
        processed.index_put_((banned.rows, banned.token_ids), minus_inf)
    if metadata.allowed_token_ids is not None:
        assert metadata.allowed_rows is not None
        apply_allowed_token_ids(processed, metadata.allowed_rows, metadata.allowed_token_ids)
    return processed


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
