"""The scheduler's half of multimodal: which images' encoder runs go with a prompt chunk.

An image's encoder runs in the step of the first chunk that covers any of its placeholders (a
chunk may end inside them: the runner keeps the output for the next chunks). The step's encoder
budget caps the encoder output tokens scheduled at once; a chunk that reaches an image over
what is left stops before it. What a request has had encoded is forgotten when it is
preempted (its runner entry is released, and its prompt recomputed from the cache's hits).
"""

from __future__ import annotations

from collections.abc import Sequence

from pagoda.multimodal.inputs import MultiModalFeatureSpec


class EncoderScheduler:
    def __init__(self, encoder_budget: int) -> None:
        self.encoder_budget = encoder_budget
        self.budget_left = encoder_budget
        # req_id -> indices of its images encoded since it last (re)started.
        self._encoded: dict[str, set[int]] = {}

    def check_fits(self, request_id: str, features: Sequence[MultiModalFeatureSpec]) -> None:
        """ValueError for an image whose encoder output could never fit one step's budget."""
        for i, feature in enumerate(features):
            if feature.mm_position.length > self.encoder_budget:
                raise ValueError(
                    f"request {request_id!r}: image {i} needs {feature.mm_position.length} encoder tokens; "
                    f"a step's encoder budget (max_num_encoder_input_tokens) is {self.encoder_budget}"
                )

    def begin_step(self) -> None:
        self.budget_left = self.encoder_budget

    def inputs_for_chunk(
        self, request_id: str, features: Sequence[MultiModalFeatureSpec], start: int, num_new: int
    ) -> tuple[int, list[int]]:
        """(the chunk's tokens, cut before the first image over the budget left; the images to
        encode with it). Nothing is committed: see `commit`."""
        encoded = self._encoded.get(request_id, ())
        scheduled: list[int] = []
        budget = self.budget_left
        for i, feature in enumerate(features):
            position = feature.mm_position
            if position.offset >= start + num_new:
                break
            if position.end <= start or i in encoded:
                continue
            if position.length > budget:
                return max(0, position.offset - start), scheduled
            scheduled.append(i)
            budget -= position.length
        return num_new, scheduled

    def commit(self, request_id: str, features: Sequence[MultiModalFeatureSpec], indices: list[int]) -> None:
        """The chunk was scheduled: its images are encoded and spend the step's budget."""
        if not indices:
            return
        self._encoded.setdefault(request_id, set()).update(indices)
        self.budget_left -= sum(features[i].mm_position.length for i in indices)

    def free(self, request_id: str) -> None:
        """The request ended or was preempted: its images are to be encoded again if it resumes."""
        self._encoded.pop(request_id, None)

    @property
    def req_ids(self) -> list[str]:
        return list(self._encoded)
