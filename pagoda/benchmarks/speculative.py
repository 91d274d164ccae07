"""Speculative decoding in `pagoda bench latency` and `pagoda bench throughput`.

With `--speculative-config JSON` a benchmark runs its workload twice in one run, speculation
off then on (two engines, the first shut down before the second starts), and reports both with
the acceptance the speculating engine's scheduler counted over the timed runs.
`--forced-acceptance ALPHA` sets `SpeculativeConfig.forced_acceptance`, which only the Python
API takes (JSON and dict configs refuse it): each draft is accepted with probability alpha
whatever the model says and the n-gram proposer fills every step's drafts, so dummy weights
time the machinery at a known acceptance rate. Its outputs are not the model's.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from pagoda import LLM
from pagoda.config import ConfigError, SpeculativeConfig
from pagoda.spec_decode.stats import SpecDecodingStats

T = TypeVar("T")

PLAIN, SPECULATIVE = "pagoda", "pagoda-spec"  # the two engines' labels


def speculative_config(args: argparse.Namespace) -> SpeculativeConfig | None:
    """The config of the speculating engine from the flags; None when speculation is off."""
    alpha = args.forced_acceptance
    if args.speculative_config is None:
        if alpha is not None:
            raise ConfigError("--forced-acceptance needs --speculative-config (it forces the acceptance of drafts)")
        return None
    if alpha is not None and not 0.0 <= alpha <= 1.0:
        raise ConfigError(f"--forced-acceptance must be in [0, 1], got {alpha}")
    config = SpeculativeConfig.from_value(args.speculative_config)
    return config if alpha is None else dataclasses.replace(config, forced_acceptance=alpha)


def engine_variants(config: SpeculativeConfig | None) -> list[tuple[str, SpeculativeConfig | None]]:
    """(label, speculative config) of each engine to run, in order: speculation off first."""
    return [(PLAIN, None)] if config is None else [(PLAIN, None), (SPECULATIVE, config)]


def describe(config: SpeculativeConfig) -> str:
    alpha = "" if config.forced_acceptance is None else f", forced acceptance {config.forced_acceptance:g}"
    return f"{config.method}, k = {config.num_speculative_tokens}{alpha}"


@dataclass(frozen=True)
class Acceptance:
    """What the verify steps of one measurement accepted (`SpecDecodingStats` over its runs)."""

    num_verify_steps: int
    num_draft_tokens: int
    num_accepted_tokens: int
    acceptance_rate: float
    mean_accepted_length: float
    per_position_acceptance: tuple[float, ...]

    @classmethod
    def of(cls, stats: SpecDecodingStats) -> Acceptance:
        return cls(
            stats.num_verify_steps,
            stats.num_draft_tokens,
            stats.num_accepted_tokens,
            stats.acceptance_rate,
            stats.mean_accepted_length,
            tuple(stats.per_position_acceptance),
        )

    def summary(self) -> str:
        positions = " ".join(f"{p:.2f}" for p in self.per_position_acceptance)
        return (
            f"acceptance rate {self.acceptance_rate:.3f}, mean accepted length {self.mean_accepted_length:.3f}, "
            f"per position [{positions}] ({self.num_verify_steps} verify steps)"
        )


AcceptanceProbe = Callable[[Callable[[], T]], tuple[T, Acceptance]]


def acceptance_probe(llm: LLM) -> AcceptanceProbe | None:
    """Runs a piece of work and returns its result with the acceptance counted while it ran;
    None for an engine without speculation. The in-process engine core's scheduler counts."""
    scheduler = llm.llm_engine.engine_core.scheduler
    if scheduler.spec_stats is None:
        return None

    def probe(work: Callable[[], T]) -> tuple[T, Acceptance]:
        before = scheduler.spec_stats.copy()
        result = work()
        return result, Acceptance.of(scheduler.spec_stats.since(before))

    return probe
