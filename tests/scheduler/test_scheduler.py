"""Scheduler driven by a fake runner: budgets, chunked prefill, FCFS, preemption, aborts, stops.

The fake runner plays the runner's side of the `SchedulerOutput` diff (it owns each
request's token history and block table) and checks the protocol on every step. It models
the KV cache's content: computing position p writes a key of the whole prefix up to p into
that position's slot, freed blocks are zeroed, and every step checks that each scheduled
request's slots hold its own prefix, so a wrong prefix-cache hit or a block shared by
mistake fails. Its sampled token is a pure function of the position, so every schedule,
preempted or pipelined, must produce the same tokens.
"""

from __future__ import annotations

import itertools
import random
import zlib
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest
from kv_cache_utils import kv_cache_config

from pagoda.config import CacheConfig, SchedulerConfig
from pagoda.outputs import EngineCoreOutput, FinishReason, ModelRunnerOutput
from pagoda.sampling_params import SamplingParams
from pagoda.scheduler.output import SchedulerOutput
from pagoda.scheduler.request import Request, RequestStatus
from pagoda.scheduler.scheduler import Scheduler

BLOCK_SIZE = 4
EOS = 7
TokenFn = Callable[[str, int], int]


def position_token(req_id: str, position: int) -> int:
    return 1000 + position


@dataclass
class RunnerRequest:
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    # prefix_keys[p] stands for the KV of position p: it depends on every token up to p.
    prefix_keys: list[int] = field(default_factory=list)

    def prefix_key(self, position: int) -> int:
        while len(self.prefix_keys) <= position:
            previous = self.prefix_keys[-1] if self.prefix_keys else 0
            self.prefix_keys.append(hash((previous, self.token_ids[len(self.prefix_keys)])))
        return self.prefix_keys[position]

    def slot(self, position: int) -> int:
        return self.block_ids[position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE


class FakeRunner:
    """Applies each diff like the real runner and samples `token_fn(req_id, position)`."""

    def __init__(self, max_model_len: int, token_fn: TokenFn) -> None:
        self.max_model_len = max_model_len
        self.token_fn = token_fn
        self.requests: dict[str, RunnerRequest] = {}
        self.kv: dict[int, int] = {}  # slot -> prefix key written there

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for block_id in so.freed_block_ids:  # the block zeroer
            for slot in range(block_id * BLOCK_SIZE, (block_id + 1) * BLOCK_SIZE):
                self.kv.pop(slot, None)
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
        for req_id in so.preempted_req_ids:
            del self.requests[req_id]
        for new in so.scheduled_new_reqs:
            assert new.req_id not in self.requests
            self.requests[new.req_id] = RunnerRequest(
                list(new.prompt_token_ids), list(new.block_ids[0]), new.num_computed_tokens
            )
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_block_ids = cached.new_block_ids[i]
            if cached.resumed_from_preemption[i]:
                token_ids = cached.resumed_token_ids[i]
                assert req_id not in self.requests and token_ids is not None and new_block_ids is not None
                self.requests[req_id] = RunnerRequest(
                    list(token_ids), list(new_block_ids[0]), cached.num_computed_tokens[i]
                )
                continue
            state = self.requests[req_id]
            assert cached.resumed_token_ids[i] is None
            assert state.num_computed_tokens == cached.num_computed_tokens[i]
            if new_block_ids is not None:
                state.block_ids.extend(new_block_ids[0])

        written: dict[int, str] = {}
        sampled = []
        for req_id, num_tokens in so.num_scheduled_tokens.items():
            state = self.requests[req_id]
            start = state.num_computed_tokens
            state.num_computed_tokens += num_tokens
            assert 0 not in state.block_ids, "the null block was handed to a request"
            assert len(state.block_ids) * BLOCK_SIZE >= state.num_computed_tokens
            assert state.num_computed_tokens <= min(len(state.token_ids), self.max_model_len)
            for block_id in state.block_ids[start // BLOCK_SIZE : -(-state.num_computed_tokens // BLOCK_SIZE)]:
                assert written.setdefault(block_id, req_id) == req_id, f"block {block_id} written by two requests"
            for position in range(start, state.num_computed_tokens):
                self.kv[state.slot(position)] = state.prefix_key(position)
            for position in range(state.num_computed_tokens):
                assert self.kv.get(state.slot(position)) == state.prefix_key(position), (
                    f"{req_id}: position {position} reads KV it did not compute"
                )
            if state.num_computed_tokens == len(state.token_ids):
                token = self.token_fn(req_id, len(state.token_ids))
                state.token_ids.append(token)
                sampled.append([token])
            else:
                sampled.append([])
        req_ids = list(so.num_scheduled_tokens)
        return ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)}, sampled)


@dataclass
class Harness:
    scheduler: Scheduler
    runner: FakeRunner
    config: SchedulerConfig
    outputs: dict[str, list[int]] = field(default_factory=dict)
    finished: dict[str, EngineCoreOutput] = field(default_factory=dict)
    steps: list[SchedulerOutput] = field(default_factory=list)

    def add(
        self,
        req_id: str,
        prompt_len: int = 0,
        *,
        tokens: list[int] | None = None,
        eos: set[int] | None = None,
        cache_salt: str | None = None,
        **params: object,
    ) -> Request:
        """Queue a request; its prompt is `tokens`, or `prompt_len` tokens unique to `req_id`."""
        params.setdefault("max_tokens", 4)
        if tokens is None:
            base = zlib.crc32(req_id.encode()) % 10_000 * 100
            tokens = [base + i for i in range(prompt_len)]
        eos_token_ids = {EOS} if eos is None else eos
        request = Request(req_id, tokens, SamplingParams(**params), eos_token_ids, cache_salt=cache_salt)
        self.scheduler.add_request(request)
        self.outputs[req_id] = []
        return request

    def submit(self) -> tuple[SchedulerOutput, ModelRunnerOutput]:
        running_before = [r.request_id for r in self.scheduler.running]
        so = self.scheduler.schedule()
        assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
        assert so.total_num_scheduled_tokens <= self.config.max_num_batched_tokens
        assert len(so.num_scheduled_tokens) <= self.config.max_num_seqs
        assert self.scheduler.num_running <= self.config.max_num_seqs
        if so.preempted_req_ids:  # victims are taken from the tail; nothing is admitted after
            assert set(running_before[-len(so.preempted_req_ids) :]) == so.preempted_req_ids
            assert not so.scheduled_new_reqs and not any(so.scheduled_cached_reqs.resumed_from_preemption)
        self.steps.append(so)
        return so, self.runner.execute(so)

    def update(self, so: SchedulerOutput, out: ModelRunnerOutput) -> list[EngineCoreOutput]:
        outputs = self.scheduler.update_from_output(so, out)
        for output in outputs:
            assert output.req_id not in self.finished
            self.outputs[output.req_id].extend(output.new_token_ids)
            if output.finished:
                self.finished[output.req_id] = output
        return outputs

    def step(self) -> SchedulerOutput:
        so, out = self.submit()
        self.update(so, out)
        return so

    def run(self, depth: int = 1, max_steps: int = 500, before_step: Callable[[int], None] | None = None) -> None:
        """Step until nothing is left to schedule or report, `depth` steps in flight."""
        in_flight: deque[tuple[SchedulerOutput, ModelRunnerOutput]] = deque()
        for step in range(max_steps):
            if before_step is not None:
                before_step(step)
            if self.scheduler.has_unfinished_requests() or self.scheduler.has_finished_requests():
                in_flight.append(self.submit())
                if len(in_flight) < depth:
                    continue
            if not in_flight:
                return
            self.update(*in_flight.popleft())
        raise AssertionError(f"not done after {max_steps} steps")

    def expected_tokens(self, request: Request, num_tokens: int) -> list[int]:
        start = request.num_prompt_tokens
        return [self.runner.token_fn(request.request_id, p) for p in range(start, start + num_tokens)]


def admitted_in(so: SchedulerOutput) -> list[str]:
    """Requests taken from the waiting queue in this step, in admission order."""
    cached = so.scheduled_cached_reqs
    resumed = (r for r, flag in zip(cached.req_ids, cached.resumed_from_preemption, strict=True) if flag)
    admitted = {new.req_id for new in so.scheduled_new_reqs}.union(resumed)
    return [req_id for req_id in so.num_scheduled_tokens if req_id in admitted]


@pytest.fixture
def make_harness() -> Iterator[Callable[..., Harness]]:
    """Build harnesses; every one must end idle (scheduler, KV pool and runner)."""
    harnesses: list[Harness] = []

    def make(
        num_blocks: int = 64,
        max_num_seqs: int = 8,
        max_num_batched_tokens: int = 32,
        max_model_len: int = 64,
        enable_chunked_prefill: bool = True,
        enable_prefix_caching: bool = True,
        token_fn: TokenFn = position_token,
        pipeline_parallel: bool = False,
    ) -> Harness:
        config = SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_chunked_prefill=enable_chunked_prefill,
            max_model_len=max_model_len,
        )
        cache_config = CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=enable_prefix_caching)
        scheduler = Scheduler(
            config,
            cache_config,
            kv_cache_config(num_blocks, cache_config.block_size),
            pipeline_parallel=pipeline_parallel,
        )
        harness = Harness(scheduler, FakeRunner(max_model_len, token_fn), config)
        harnesses.append(harness)
        return harness

    yield make
    for harness in harnesses:
        harness.scheduler.check_idle()
        assert not harness.runner.requests, f"runner still holds {sorted(harness.runner.requests)}"


# ---- budget, chunking, batch shape --------------------------------------------------------


def test_chunked_prefill_splits_a_long_prompt_in_budget_sized_chunks(make_harness) -> None:
    h = make_harness(max_num_batched_tokens=16)
    request = h.add("a", 50, max_tokens=3)
    h.run()
    assert [so.num_scheduled_tokens["a"] for so in h.steps[:6]] == [16, 16, 16, 2, 1, 1]
    assert h.outputs["a"] == h.expected_tokens(request, 3)
    assert h.finished["a"].finish_reason == FinishReason.LENGTH


def test_token_budget_is_respected_with_many_requests(make_harness) -> None:
    h = make_harness(max_num_batched_tokens=20, max_num_seqs=6)
    requests = [h.add(f"r{i}", 9 + 7 * i, max_tokens=5) for i in range(6)]
    h.run()  # Harness.submit checks the budget on every step
    assert max(so.total_num_scheduled_tokens for so in h.steps) == 20
    for request in requests:
        assert h.outputs[request.request_id] == h.expected_tokens(request, 5)


def test_chunked_prefill_off_schedules_prompts_whole(make_harness) -> None:
    h = make_harness(max_num_batched_tokens=32, max_model_len=32, enable_chunked_prefill=False)
    for req_id, prompt_len in (("a", 20), ("b", 10), ("c", 20)):
        h.add(req_id, prompt_len)
    first = h.step()
    assert first.num_scheduled_tokens == {"a": 20, "b": 10}  # c does not fit and is not split
    second = h.step()
    assert second.num_scheduled_tokens == {"a": 1, "b": 1, "c": 20}
    h.run()


def test_chunked_prefill_on_splits_what_does_not_fit(make_harness) -> None:
    h = make_harness(max_num_batched_tokens=32, max_model_len=32)
    for req_id, prompt_len in (("a", 20), ("b", 10), ("c", 20)):
        h.add(req_id, prompt_len)
    assert h.step().num_scheduled_tokens == {"a": 20, "b": 10, "c": 2}
    h.run()


def test_chunked_prefill_off_needs_a_budget_of_max_model_len() -> None:
    config = SchedulerConfig(max_num_batched_tokens=16, enable_chunked_prefill=False, max_model_len=32)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        Scheduler(config, CacheConfig(block_size=BLOCK_SIZE), kv_cache_config(64, BLOCK_SIZE))


def test_max_num_seqs_and_fcfs_order(make_harness) -> None:
    h = make_harness(max_num_seqs=2)
    requests = [h.add(f"r{i}", 6, max_tokens=2 + i) for i in range(5)]
    h.run()
    admitted = [req_id for so in h.steps for req_id in admitted_in(so)]
    assert admitted == [r.request_id for r in requests]
    assert max(len(so.num_scheduled_tokens) for so in h.steps) == 2
    for request in requests:
        assert h.outputs[request.request_id] == h.expected_tokens(request, request.max_tokens)


def test_fcfs_with_one_sequence_finishes_in_arrival_order(make_harness) -> None:
    h = make_harness(max_num_seqs=1)
    for i in range(4):
        h.add(f"r{i}", 5, max_tokens=4 - i)  # later arrivals are shorter, still finish later
    h.run()
    assert list(h.finished) == ["r0", "r1", "r2", "r3"]


def test_decodes_of_running_requests_come_before_new_prefills(make_harness) -> None:
    h = make_harness(max_num_batched_tokens=8)
    h.add("a", 4, max_tokens=6)
    h.add("b", 4, max_tokens=6)
    assert h.step().num_scheduled_tokens == {"a": 4, "b": 4}
    h.add("c", 30, max_tokens=2)
    so = h.step()
    assert list(so.num_scheduled_tokens.items()) == [("a", 1), ("b", 1), ("c", 6)]
    assert [new.req_id for new in so.scheduled_new_reqs] == ["c"]
    assert so.scheduled_cached_reqs.req_ids == ["a", "b"]
    h.run()


def test_running_requests_get_only_appended_block_ids(make_harness) -> None:
    h = make_harness(max_num_batched_tokens=64)
    h.add("a", 7, max_tokens=6)
    first = h.step()  # 7 tokens: blocks 0-1
    assert len(first.scheduled_new_reqs[0].block_ids[0]) == 2
    second = h.step()  # the 8th token still fits block 1
    assert second.scheduled_cached_reqs.new_block_ids == [None]
    third = h.step()  # the 9th token opens block 2
    (appended,) = third.scheduled_cached_reqs.new_block_ids
    assert appended is not None and len(appended[0]) == 1
    h.run()


# ---- preemption ---------------------------------------------------------------------------


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_preemption_by_recompute_resumes_and_finishes_everything(make_harness, depth: int) -> None:
    # Each request may need cdiv(8 + 12 - 1, 4) = 5 blocks; three of them do not fit in 11.
    h = make_harness(num_blocks=12, max_num_batched_tokens=32)
    requests = {f"r{i}": h.add(f"r{i}", 8, max_tokens=12) for i in range(3)}
    h.run(depth=depth)

    first_preemption = next(so for so in h.steps if so.preempted_req_ids)
    assert first_preemption.preempted_req_ids == {"r2"}  # the most recently arrived running request
    resumed = []
    for so in h.steps:
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            if not cached.resumed_from_preemption[i]:
                continue
            resumed.append(req_id)
            request = requests[req_id]
            history = cached.resumed_token_ids[i]
            assert history is not None
            assert history == request.all_token_ids[: len(history)]  # prompt + every output so far
            block_ids = cached.new_block_ids[i]
            assert block_ids is not None
            num_tokens = cached.num_computed_tokens[i] + so.num_scheduled_tokens[req_id]
            assert len(block_ids[0]) == -(-num_tokens // BLOCK_SIZE)  # the full, replacing block list
    assert "r2" in resumed
    assert h.scheduler.make_stats().num_preemptions == sum(len(so.preempted_req_ids) for so in h.steps)
    for req_id, request in requests.items():
        assert h.outputs[req_id] == h.expected_tokens(request, 12)
        assert h.finished[req_id].finish_reason == FinishReason.LENGTH


def test_pipeline_parallel_leaves_in_flight_requests_out_and_sends_their_new_tokens(make_harness) -> None:
    """Two batches in flight (one per stage): a request whose token is still in flight is not in
    the next batch, so consecutive batches differ; each scheduled request carries the tokens
    sampled since it last ran (for the stages that do not sample), and the outputs are the same."""
    h = make_harness(num_blocks=16, max_num_batched_tokens=16, pipeline_parallel=True)
    requests = [h.add(f"r{i}", 3 + 4 * i, max_tokens=6) for i in range(4)]
    h.run(depth=2)
    for request in requests:
        assert h.outputs[request.request_id] == h.expected_tokens(request, 6)
    prompt_lens = {request.request_id: request.num_prompt_tokens for request in requests}
    for earlier, later in itertools.pairwise(h.steps):
        sampled = {r for r in earlier.num_scheduled_tokens if _num_computed_after(earlier, r) >= prompt_lens[r]}
        assert not sampled & set(later.num_scheduled_tokens), "a request with a token in flight was rescheduled"
    num_sent = 0
    for so in h.steps:
        cached = so.scheduled_cached_reqs
        assert len(cached.new_token_ids) == cached.num_reqs
        for req_id, computed, new_ids in zip(
            cached.req_ids, cached.num_computed_tokens, cached.new_token_ids, strict=True
        ):
            start = max(computed, prompt_lens[req_id])
            assert new_ids == [position_token(req_id, p) for p in range(start, start + len(new_ids))]
            assert len(new_ids) == (1 if computed >= prompt_lens[req_id] else 0)
            num_sent += len(new_ids)
    assert num_sent >= 4 * 4


def _num_computed_after(so: SchedulerOutput, req_id: str) -> int:
    """A request's computed tokens once step `so` ran."""
    cached = so.scheduled_cached_reqs
    before = dict(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
    before.update((new.req_id, new.num_computed_tokens) for new in so.scheduled_new_reqs)
    return before[req_id] + so.num_scheduled_tokens[req_id]


def test_preempted_request_resumes_before_later_arrivals(make_harness) -> None:
    h = make_harness(num_blocks=12, max_num_batched_tokens=32, max_num_seqs=3)
    for i in range(4):
        h.add(f"r{i}", 8, max_tokens=12)  # r3 waits for a free sequence slot
    h.run()
    preempted_at = next(i for i, so in enumerate(h.steps) if "r2" in so.preempted_req_ids)
    admitted = [req_id for so in h.steps[preempted_at:] for req_id in admitted_in(so)]
    assert admitted[:2] == ["r2", "r3"]


def test_resumed_request_reuses_its_cached_prefix(make_harness) -> None:
    h = make_harness(num_blocks=12, max_num_batched_tokens=32)
    for i in range(3):
        h.add(f"r{i}", 8, max_tokens=12)
    h.run()
    resumed_computed = [
        so.scheduled_cached_reqs.num_computed_tokens[i]
        for so in h.steps
        for i, resumed in enumerate(so.scheduled_cached_reqs.resumed_from_preemption)
        if resumed
    ]
    assert resumed_computed and all(n > 0 for n in resumed_computed)


# ---- aborts and finishes ------------------------------------------------------------------


def _setup_waiting(h: Harness) -> str:
    h.add("a", 4, max_tokens=8)
    h.add("victim", 4)
    h.step()
    return "victim"


def _setup_mid_prefill(h: Harness) -> str:
    h.add("victim", 30)
    h.step()
    return "victim"


def _setup_decoding(h: Harness) -> str:
    h.add("victim", 4, max_tokens=8)
    h.step()
    h.step()
    return "victim"


def _setup_preempted(h: Harness) -> str:
    for i in range(3):
        h.add(f"r{i}", 8, max_tokens=12)
    for _ in range(50):
        h.step()
        if h.scheduler.waiting and h.scheduler.waiting[0].status == RequestStatus.PREEMPTED:
            return h.scheduler.waiting[0].request_id
    raise AssertionError("no preemption happened")


@pytest.mark.parametrize(
    ("setup", "expected_status"),
    [
        (_setup_waiting, RequestStatus.WAITING),
        (_setup_mid_prefill, RequestStatus.RUNNING),
        (_setup_decoding, RequestStatus.RUNNING),
        (_setup_preempted, RequestStatus.PREEMPTED),
    ],
)
def test_abort_in_any_state_frees_blocks_and_reports_the_id(make_harness, setup, expected_status) -> None:
    h = make_harness(num_blocks=12, max_num_batched_tokens=8, max_num_seqs=1 if setup is _setup_waiting else 8)
    victim_id = setup(h)
    victim = h.scheduler.requests[victim_id]
    assert victim.status == expected_status
    if setup is _setup_mid_prefill:
        assert 0 < victim.num_computed_tokens < victim.num_prompt_tokens
    if setup is _setup_decoding:
        assert victim.num_output_tokens > 0
    holds_blocks = any(h.scheduler.kv_cache_manager.get_block_ids(victim))
    assert holds_blocks == (expected_status == RequestStatus.RUNNING)
    usage_before = h.scheduler.kv_cache_manager.usage

    h.scheduler.abort_requests([victim_id])
    assert victim.status == RequestStatus.FINISHED_ABORTED
    assert victim_id not in h.scheduler.requests
    assert h.scheduler.kv_cache_manager.get_block_ids(victim) == ([],)
    if holds_blocks:
        assert h.scheduler.kv_cache_manager.usage < usage_before
    so = h.step()
    assert victim_id in so.finished_req_ids
    assert victim_id not in so.num_scheduled_tokens
    h.run()
    assert victim_id not in h.finished  # the engine reports aborts itself


def test_abort_ignores_unknown_and_finished_ids(make_harness) -> None:
    h = make_harness()
    h.add("a", 4, max_tokens=1)
    h.run()
    h.scheduler.abort_requests(["a", "never-seen"])
    h.scheduler.abort_requests("a")
    assert not h.scheduler.has_finished_requests()


def test_late_token_after_abort_is_dropped(make_harness) -> None:
    h = make_harness()
    h.add("a", 4, max_tokens=8)
    h.add("b", 4, max_tokens=2)
    so, out = h.submit()
    assert out.sampled_token_ids[out.req_id_to_index["a"]]  # a's token is in flight
    h.scheduler.abort_requests(["a"])
    outputs = h.update(so, out)
    assert [o.req_id for o in outputs] == ["b"]
    h.run()
    assert h.outputs["a"] == []


def test_finish_requests_for_a_stop_string(make_harness) -> None:
    h = make_harness()
    h.add("a", 4, max_tokens=8)
    h.step()
    h.scheduler.finish_requests(["a"], RequestStatus.FINISHED_STOPPED)
    assert h.step().finished_req_ids == {"a"}
    with pytest.raises(ValueError, match="finished status"):
        h.scheduler.finish_requests(["a"], RequestStatus.RUNNING)
    h.run()


# ---- stop reasons -------------------------------------------------------------------------


def emit_at(token: int, *output_indices: int, prompt_len: int = 5) -> TokenFn:
    positions = {prompt_len + i for i in output_indices}
    return lambda req_id, position: token if position in positions else position_token(req_id, position)


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize(
    ("token_fn", "eos", "params", "num_tokens", "reason", "stop_reason"),
    [
        (emit_at(42, 2), set(), {"stop_token_ids": [42]}, 3, FinishReason.STOP, 42),
        (emit_at(EOS, 2), None, {}, 3, FinishReason.STOP, None),
        (emit_at(99, 1), set(), {"all_stop_token_ids": {99}}, 2, FinishReason.STOP, None),
        (emit_at(EOS, 2), None, {"ignore_eos": True}, 6, FinishReason.LENGTH, None),
        (emit_at(EOS, 1, 4), None, {"min_tokens": 3}, 5, FinishReason.STOP, None),
        (emit_at(42, 0, 3), set(), {"stop_token_ids": [42], "min_tokens": 2}, 4, FinishReason.STOP, 42),
        (position_token, None, {}, 6, FinishReason.LENGTH, None),
    ],
    ids=["stop_token_id", "eos", "all_stop_token_ids", "ignore_eos", "min_tokens_eos", "min_tokens_stop_id", "max"],
)
def test_stop_reasons(make_harness, depth, token_fn, eos, params, num_tokens, reason, stop_reason) -> None:
    h = make_harness(token_fn=token_fn)
    h.add("a", 5, eos=eos, max_tokens=6, **params)
    h.run(depth=depth)
    assert len(h.outputs["a"]) == num_tokens
    assert h.finished["a"].finish_reason == reason
    assert h.finished["a"].stop_reason == stop_reason


@pytest.mark.parametrize("depth", [1, 2])
def test_max_model_len_caps_a_request_without_max_tokens(make_harness, depth: int) -> None:
    h = make_harness(max_model_len=16)
    request = h.add("a", 10, max_tokens=None)
    h.run(depth=depth)
    assert h.outputs["a"] == h.expected_tokens(request, 6)
    assert request.num_tokens == 16
    assert h.finished["a"].finish_reason == FinishReason.LENGTH


def test_pipelined_steps_schedule_no_token_past_max_tokens(make_harness) -> None:
    h = make_harness()
    h.add("a", 5, max_tokens=4)
    h.run(depth=2)
    # 5 prompt tokens + 3 fed-back outputs; the 4th output is never fed back.
    assert sum(so.num_scheduled_tokens.get("a", 0) for so in h.steps) == 8


def test_pipelined_eos_drops_the_token_sampled_after_it(make_harness) -> None:
    h = make_harness(token_fn=emit_at(EOS, 1))
    h.add("a", 5, max_tokens=6)
    h.run(depth=2)
    assert h.outputs["a"] == [1005, EOS]
    assert sum(1 for so in h.steps if "a" in so.num_scheduled_tokens) == 3  # one step ran past the eos


# ---- admission checks ---------------------------------------------------------------------


def test_add_request_refuses_requests_that_cannot_run(make_harness) -> None:
    h = make_harness(num_blocks=8, max_model_len=32)
    with pytest.raises(ValueError, match="must not be empty"):
        h.add("empty", 0)
    with pytest.raises(ValueError, match="max_model_len - 1 = 31"):
        h.add("long", 32)
    with pytest.raises(ValueError, match="pool has 7"):
        h.add("huge", 20, max_tokens=12)  # 31 tokens hold KV: 8 blocks
    h.add("fits", 27, max_tokens=2)  # 28 tokens: 7 blocks
    with pytest.raises(ValueError, match="already in use"):
        h.add("fits", 4)
    h.run()
    assert h.finished["fits"].finish_reason == FinishReason.LENGTH


# ---- prefix caching, freed blocks, stats --------------------------------------------------


def test_prefix_cache_hit_through_the_scheduler(make_harness) -> None:
    h = make_harness()
    tokens = list(range(100, 110))
    h.add("a", tokens=tokens, max_tokens=1)
    h.run()
    h.add("b", tokens=tokens, max_tokens=1)
    so = h.step()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 8
    assert so.num_scheduled_tokens == {"b": 2}
    stats = h.scheduler.make_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (20, 8)
    assert stats.prefix_cache_hit_rate == pytest.approx(0.4)
    h.run()
    assert h.outputs["b"] == h.outputs["a"]


def test_blocks_filled_by_generated_tokens_are_cached(make_harness) -> None:
    h = make_harness()
    first = h.add("a", tokens=list(range(100, 106)), max_tokens=7)  # 13 tokens: 3 full blocks
    h.run()
    h.add("b", tokens=[*first.all_token_ids, 5], max_tokens=1)
    assert h.step().scheduled_new_reqs[0].num_computed_tokens == 12
    h.run()


def test_salted_requests_and_a_reset_cache_miss(make_harness) -> None:
    h = make_harness()
    tokens = list(range(100, 110))
    h.add("a", tokens=tokens, max_tokens=1)
    h.run()
    h.add("salted", tokens=tokens, cache_salt="tenant", max_tokens=1)
    assert h.step().scheduled_new_reqs[0].num_computed_tokens == 0
    h.run()
    h.scheduler.reset_prefix_cache()
    h.add("after-reset", tokens=tokens, max_tokens=1)
    assert h.step().scheduled_new_reqs[0].num_computed_tokens == 0
    h.run()


def test_freed_block_ids_reach_the_next_scheduler_output(make_harness) -> None:
    h = make_harness(enable_prefix_caching=False)
    h.add("a", 6, max_tokens=3)
    block_ids = list(h.step().scheduled_new_reqs[0].block_ids[0])
    h.step()
    h.step()  # a finishes
    assert "a" in h.finished
    so = h.step()
    assert so.finished_req_ids == {"a"}
    assert sorted(so.freed_block_ids) == sorted(block_ids)
    h.run()


def test_stats_and_counts(make_harness) -> None:
    h = make_harness(max_num_seqs=1)
    h.add("a", 8, max_tokens=2)
    h.add("b", 8, max_tokens=2)
    assert h.scheduler.get_num_unfinished_requests() == 2
    h.step()
    stats = h.scheduler.make_stats()
    assert (stats.num_running_reqs, stats.num_waiting_reqs) == (1, 1)
    assert (h.scheduler.num_running, h.scheduler.num_waiting) == (1, 1)
    assert stats.kv_cache_usage == pytest.approx(2 / 63)
    h.run()
    assert not h.scheduler.has_unfinished_requests()


# ---- random workloads ---------------------------------------------------------------------


@pytest.mark.parametrize("depth", [1, 2, 3])
@pytest.mark.parametrize("seed", range(100))
def test_random_workloads_keep_every_invariant(make_harness, seed: int, depth: int) -> None:
    """Arrivals over time, shared prefixes, a small pool, aborts: the runner's checks hold and
    every request that is not aborted gets exactly its tokens."""
    rng = random.Random(seed)
    max_model_len = 40
    h = make_harness(
        num_blocks=rng.randint(10, 16),
        max_num_batched_tokens=rng.choice([6, 8, 16, 32]),
        max_num_seqs=rng.choice([2, 4, 8]),
        max_model_len=max_model_len,
        enable_prefix_caching=rng.random() < 0.8,
    )
    prefixes = [[rng.randrange(40) for _ in range(rng.randint(4, 16))] for _ in range(3)]
    arrivals = deque(sorted(rng.randrange(20) for _ in range(12)))
    requests: dict[str, Request] = {}
    aborted: set[str] = set()

    def before_step(step: int) -> None:
        # Arrivals due by this step; when idle, the next one comes at once.
        while arrivals and (arrivals[0] <= step or not h.scheduler.has_unfinished_requests()):
            arrivals.popleft()
            tokens = rng.choice(prefixes) + [rng.randrange(40) for _ in range(rng.randint(1, 8))]
            req_id = f"r{len(requests)}"
            requests[req_id] = h.add(req_id, tokens=tokens, max_tokens=rng.randint(1, 12))
        live = sorted(set(h.scheduler.requests) - aborted)
        if live and rng.random() < 0.03:
            victim = rng.choice(live)
            h.scheduler.abort_requests([victim])
            aborted.add(victim)

    h.run(depth=depth, before_step=before_step, max_steps=2000)
    assert len(requests) == 12
    for req_id, request in requests.items():
        expected = h.expected_tokens(request, min(request.max_tokens, max_model_len - request.num_prompt_tokens))
        if req_id in aborted:
            assert h.outputs[req_id] == expected[: len(h.outputs[req_id])]
        else:
            assert h.outputs[req_id] == expected


def test_a_request_sharing_a_prefix_computed_this_step_waits_to_hit_it(make_harness) -> None:
    """Shared system prompts: b's first block is one a computes in this step, so b waits a step and
    hits a's blocks (one copy, read once per decode step by the cascade); c shares nothing and goes."""
    h = make_harness(max_num_batched_tokens=64)
    system = [500 + i for i in range(12)]  # 3 blocks of 4
    h.add("a", tokens=[*system, 1, 2], max_tokens=3)
    h.add("b", tokens=[*system, 3], max_tokens=3)
    h.add("c", 9, max_tokens=3)
    first = h.step()
    assert admitted_in(first) == ["a", "c"]
    second = h.step()
    (new,) = second.scheduled_new_reqs
    assert new.req_id == "b" and new.num_computed_tokens == 12
    assert new.block_ids[0][:3] == first.scheduled_new_reqs[0].block_ids[0][:3]
    h.run()
