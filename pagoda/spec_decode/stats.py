"""Acceptance figures of speculative decoding, as the scheduler counts them (cumulative)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodingStats:
    """Counts since the engine started; `accepted_per_position[j]`: verify steps whose draft j
    (0-based) was accepted, out of `drafted_per_position[j]` that drafted one there."""

    num_verify_steps: int = 0  # a request's step with at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)

    def observe(self, num_drafts: int, num_accepted: int) -> None:
        """One request's verify step: `num_drafts` drafted, the first `num_accepted` of them kept."""
        self.num_verify_steps += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        grow = num_drafts - len(self.drafted_per_position)
        if grow > 0:
            self.drafted_per_position += [0] * grow
            self.accepted_per_position += [0] * grow
        for j in range(num_drafts):
            self.drafted_per_position[j] += 1
        for j in range(num_accepted):
            self.accepted_per_position[j] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts over proposed drafts."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verify step emits on average: its accepted drafts plus the model's own token."""
        return 1.0 + self.num_accepted_tokens / self.num_verify_steps if self.num_verify_steps else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        return [
            accepted / drafted if drafted else 0.0
            for accepted, drafted in zip(self.accepted_per_position, self.drafted_per_position, strict=True)
        ]

    def since(self, earlier: SpecDecodingStats) -> SpecDecodingStats:
        """The counts added after `earlier` (a copy of these stats taken before): one run's figures."""
        width = len(self.drafted_per_position)

        def pad(counts: list[int]) -> list[int]:
            return counts + [0] * (width - len(counts))

        return SpecDecodingStats(
            self.num_verify_steps - earlier.num_verify_steps,
            self.num_draft_tokens - earlier.num_draft_tokens,
            self.num_accepted_tokens - earlier.num_accepted_tokens,
            [a - b for a, b in zip(self.drafted_per_position, pad(earlier.drafted_per_position), strict=True)],
            [a - b for a, b in zip(self.accepted_per_position, pad(earlier.accepted_per_position), strict=True)],
        )

    def copy(self) -> SpecDecodingStats:
        return SpecDecodingStats(
            self.num_verify_steps,
            self.num_draft_tokens,
            self.num_accepted_tokens,
            list(self.drafted_per_position),
            list(self.accepted_per_position),
        )
