"""Speculative decoding: proposers of draft tokens and the verification that keeps outputs.

A proposer drafts up to k tokens per decoding request; the scheduler reserves their KV slots
and sends them in `SchedulerOutput.scheduled_spec_decode_tokens`; the runner computes the
model's logits at all k + 1 positions in one forward and `verification` keeps the drafts the
model's own sampler agrees with, plus the model's token after the last of them.
"""
