"""Speculative decoding: proposers of draft tokens and the verification that keeps outputs.

A proposer drafts up to k tokens per decoding request; the scheduler reserves their KV slots
and sends them in `SchedulerOutput.scheduled_spec_decode_tokens`; the runner computes the
model's logits at all k + 1 positions in one forward and `verification` keeps the drafts the
model's own sampler agrees with, plus the model's token after the last of them.

Proposers: `ngram` (prompt lookup, in the scheduler), and in the runner, returning each step's
drafts with its output: `draft_model` (a small model of the target's vocabulary) and
`eagle`/`eagle3` (EAGLE heads over the target's hidden states); their KV shares the engine's
KV-cache pool (see `draft_model`).
"""
