"""Logprob arrays from the core turned into the user-facing {token id: Logprob} dicts."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from pagoda.outputs import Logprob, LogprobsArrays


def to_logprob_dicts(arrays: LogprobsArrays, tokenizer: PreTrainedTokenizerBase | None) -> list[dict[int, Logprob]]:
    """One dict per position: the chosen token first, then the top ones in rank order, each with its text.

    A chosen token that is also among the top ones appears once, with its own rank.
    """
    token_ids = arrays.token_ids.tolist()
    texts = None
    if tokenizer is not None:
        flat = [[token_id] for row in token_ids for token_id in row]
        decoded = tokenizer.batch_decode(flat, skip_special_tokens=False) if flat else []
        width = arrays.token_ids.shape[1]
        texts = [decoded[i * width : (i + 1) * width] for i in range(len(token_ids))]
    dicts = []
    rows = zip(token_ids, arrays.logprobs.tolist(), arrays.ranks.tolist(), strict=True)
    for position, (ids, values, ranks) in enumerate(rows):
        entry: dict[int, Logprob] = {}
        for column, token_id in enumerate(ids):
            if token_id not in entry:
                text = texts[position][column] if texts is not None else None
                entry[token_id] = Logprob(values[column], ranks[column], text)
        dicts.append(entry)
    return dicts
