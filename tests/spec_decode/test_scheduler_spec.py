"""The scheduler's side of speculative decoding, with hand-made runner outputs: draft slots
reserved and budgeted, rejected ones taken back and never cached, length caps, steps scheduled
behind a verify step in flight (and when they wait for it)."""

from __future__ import annotations

from kv_cache_utils import kv_cache_config

from pagoda.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from pagoda.outputs import ModelRunnerOutput
from pagoda.sampling_params import SamplingParams
from pagoda.scheduler.output import SchedulerOutput
from pagoda.scheduler.request import Request
from pagoda.scheduler.scheduler import Scheduler

BLOCK_SIZE = 4
K = 3
# Repeats: after it, n-gram lookup of [1, 2] drafts [3, 4, 1].
PROMPT = [1, 2, 3, 4, 1, 2]


def make_scheduler(budget: int = 64, num_blocks: int = 32, max_model_len: int = 64) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget, max_model_len=max_model_len),
        CacheConfig(block_size=BLOCK_SIZE),
        kv_cache_config(num_blocks, BLOCK_SIZE),
        speculative_config=SpeculativeConfig("ngram", K, prompt_lookup_min=2, prompt_lookup_max=3),
    )


def add(scheduler: Scheduler, req_id: str, prompt: list[int] = PROMPT, max_tokens: int = 32) -> Request:
    request = Request(req_id, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), eos_token_ids=set())
    scheduler.add_request(request)
    return request


def output(so: SchedulerOutput, tokens: dict[str, list[int]]) -> ModelRunnerOutput:
    req_ids = list(so.num_scheduled_tokens)
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={req_id: i for i, req_id in enumerate(req_ids)},
        sampled_token_ids=[tokens.get(req_id, []) for req_id in req_ids],
    )


def num_blocks_held(scheduler: Scheduler, request: Request) -> int:
    return scheduler.kv_cache_manager.num_held_blocks(request)[0]


def test_drafts_are_scheduled_budgeted_and_rejected_ones_taken_back() -> None:
    scheduler = make_scheduler()
    request = add(scheduler, "a")
    prefill = scheduler.schedule()
    assert prefill.scheduled_spec_decode_tokens == {}  # a prefill step drafts nothing
    scheduler.update_from_output(prefill, output(prefill, {"a": [3]}))  # history ... 1, 2, 3: drafts 4, 1, 2

    verify = scheduler.schedule()
    assert verify.scheduled_spec_decode_tokens == {"a": [4, 1, 2]}
    assert verify.num_scheduled_tokens == {"a": 1 + K} and verify.total_num_scheduled_tokens == 1 + K
    assert request.num_computed_tokens == len(PROMPT) + 1 + K  # slots for every draft
    assert num_blocks_held(scheduler, request) == 3  # 10 tokens of KV in blocks of 4

    # The model agreed with the first draft only: tokens 4 (accepted) and 9 (its own).
    scheduler.update_from_output(verify, output(verify, {"a": [4, 9]}))
    assert request.output_token_ids == [3, 4, 9]
    assert request.num_computed_tokens == len(PROMPT) + 2  # the last token is not computed yet
    stats = scheduler.make_stats().spec_decoding
    assert (stats.num_draft_tokens, stats.num_accepted_tokens, stats.accepted_per_position) == (3, 1, [1, 0, 0])
    assert stats.mean_accepted_length == 2.0 and abs(stats.acceptance_rate - 1 / 3) < 1e-9
    # Nothing past the verified tokens is cached (the third block holds rejected drafts' KV).
    cached = scheduler.kv_cache_manager.managers[0].num_cached_blocks
    so = scheduler.schedule()
    assert so.scheduled_spec_decode_tokens == {}  # ... 3, 4, 9: no match
    scheduler.update_from_output(so, output(so, {"a": [1]}))
    assert cached["a"] == 2 == request.num_computed_tokens // BLOCK_SIZE
    scheduler.finish_requests("a", request.status.FINISHED_ABORTED)
    scheduler.schedule()
    scheduler.check_idle()


def test_drafts_stop_at_max_tokens_max_model_len_and_the_budget() -> None:
    scheduler = make_scheduler()
    capped = add(scheduler, "a", max_tokens=3)
    scheduler.update_from_output(so := scheduler.schedule(), output(so, {"a": [3]}))
    so = scheduler.schedule()
    # 2 outputs left: at most one draft (it and the model's token after it).
    assert so.scheduled_spec_decode_tokens == {"a": [4]}
    scheduler.update_from_output(so, output(so, {"a": [4, 1]}))
    assert capped.is_finished and capped.num_output_tokens == 3

    short = make_scheduler(max_model_len=10)
    request = add(short, "c")  # 6 prompt tokens, max_model_len 10: at most 4 tokens
    short.update_from_output(so := short.schedule(), output(so, {"c": [3]}))
    so = short.schedule()
    assert so.scheduled_spec_decode_tokens == {"c": [4, 1]}  # and the model's token: 10 tokens
    short.update_from_output(so, output(so, {"c": [4, 1, 2]}))
    assert request.is_finished and request.num_tokens == 10

    tight = make_scheduler(budget=6)
    add(tight, "d")
    add(tight, "e")
    tight.update_from_output(so := tight.schedule(), output(so, {"d": [3]}))  # d's prefill fills the budget
    so = tight.schedule()  # d decodes (1 + 3 drafts), e's prefill gets the 2 tokens left
    assert so.num_scheduled_tokens == {"d": 4, "e": 2} and so.total_num_scheduled_tokens == 6
    tight2 = make_scheduler(budget=6)
    add(tight2, "f", prompt=[9, 9, 9, 9, 9])
    tight2.update_from_output(so := tight2.schedule(), output(so, {"f": [9]}))
    add(tight2, "g", prompt=[1, 2, 3, 4, 5])
    so = tight2.schedule()  # f first: its drafts take what the budget has, then g's prefill
    assert so.scheduled_spec_decode_tokens == {"f": [9, 9, 9]} and so.num_scheduled_tokens["g"] == 2
    tight3 = make_scheduler(budget=3)
    add(tight3, "h", prompt=[9] * 6)
    tight3.update_from_output(so := tight3.schedule(), output(so, {}))  # the prompt in chunks of 3
    tight3.update_from_output(so := tight3.schedule(), output(so, {"h": [9]}))
    assert tight3.schedule().scheduled_spec_decode_tokens == {"h": [9, 9]}  # 3 tokens: 1 + 2 drafts


def test_a_request_waits_for_its_verify_step_but_not_for_a_plain_one() -> None:
    """With a batch queue of depth 2: the next step is scheduled before the last one's output."""
    scheduler = make_scheduler()
    request = add(scheduler, "a")
    first = scheduler.schedule()  # prefill: samples token 3, still in flight
    second = scheduler.schedule()
    # Proposed from the stale history (it ends at 2): drafts 3, 4, 1, 2 less the guess 3.
    assert second.scheduled_spec_decode_tokens == {"a": [4, 1, 2]}
    third = scheduler.schedule()
    assert third.num_scheduled_tokens == {}  # two steps in flight: it runs behind one at most
    scheduler.update_from_output(first, output(first, {"a": [3]}))
    scheduler.update_from_output(second, output(second, {"a": [4, 1, 2, 3]}))  # all accepted
    assert request.output_token_ids == [3, 4, 1, 2, 3]
    assert request.num_computed_tokens == request.num_tokens - 1
    assert scheduler.schedule().scheduled_spec_decode_tokens["a"]


def test_no_room_for_the_drafts_schedules_the_plain_step() -> None:
    # 3 usable blocks of 4: the prompt and first token fill 7 slots; drafts would need a third... and a fourth.
    scheduler = make_scheduler(num_blocks=3)
    request = add(scheduler, "a", max_tokens=2)
    scheduler.update_from_output(so := scheduler.schedule(), output(so, {"a": [3]}))
    so = scheduler.schedule()
    assert so.scheduled_spec_decode_tokens == {} and so.num_scheduled_tokens == {"a": 1}
    scheduler.update_from_output(so, output(so, {"a": [4]}))
    assert request.is_finished


def test_a_request_runs_behind_its_verify_step_in_flight_and_is_corrected_one_step_late() -> None:
    """With a batch queue of depth 2 (async scheduling): while a verify step is in flight its
    request's next step is scheduled as if every draft were accepted, the counts taken back
    when the accepted count comes; only KV below the history it completes is cached."""
    scheduler = make_scheduler()
    request = add(scheduler, "a")
    scheduler.update_from_output(so := scheduler.schedule(), output(so, {"a": [3]}))  # ... 1, 2, 3
    verify = scheduler.schedule()
    assert verify.scheduled_spec_decode_tokens == {"a": [4, 1, 2]} and not verify.behind_verify
    assert request.num_computed_tokens == 7 + K

    behind = scheduler.schedule()  # the verify step is in flight
    # Proposed past its drafts, guessed accepted: ... 1, 2, 3, 4, 1, 2 drafts 3, 4, 1, 2 less the
    # guess 3 (the token the verify step emits after them).
    assert behind.behind_verify == {"a"} and behind.scheduled_spec_decode_tokens == {"a": [4, 1, 2]}
    assert behind.num_scheduled_tokens == {"a": 1 + K}
    assert behind.scheduled_cached_reqs.num_computed_tokens == [7 + K]  # laid out as if all were accepted
    assert request.num_computed_tokens == 7 + K + 1 + K and num_blocks_held(scheduler, request) == 4

    # The verify step accepted one draft (4) and emitted 9: two rejected, taken back now.
    scheduler.update_from_output(verify, output(verify, {"a": [4, 9]}))
    assert request.output_token_ids == [3, 4, 9] and request.num_computed_tokens == 7 + K + 1 + K - 2
    # The step in flight was proposed for a history that did not come true: the next is proposed
    # as if it accepts nothing (... 4, 9 and its token: no match), so nothing runs behind it.
    assert not request.inflight_drafts_follow
    assert scheduler.schedule().num_scheduled_tokens == {}

    # The step behind it (9 at position 8, drafts 4, 1, 2) accepted none and emitted 1.
    scheduler.update_from_output(behind, output(behind, {"a": [1]}))
    assert request.output_token_ids == [3, 4, 9, 1]
    assert request.num_computed_tokens == request.num_tokens - 1 == 9
    assert scheduler.kv_cache_manager.managers[0].num_cached_blocks["a"] == 9 // BLOCK_SIZE
    stats = scheduler.make_stats().spec_decoding
    assert (stats.num_verify_steps, stats.num_draft_tokens, stats.num_accepted_tokens) == (2, 6, 1)
    scheduler.finish_requests("a", request.status.FINISHED_ABORTED)
    scheduler.schedule()
    scheduler.check_idle()


def test_a_step_behind_a_verify_step_keeps_its_worst_case_within_max_tokens() -> None:
    # 1 output and up to 1 + 3 in flight: with max_tokens 7 one draft and its token fit behind.
    scheduler = make_scheduler()
    request = add(scheduler, "a", max_tokens=7)
    scheduler.update_from_output(so := scheduler.schedule(), output(so, {"a": [3]}))
    verify = scheduler.schedule()
    behind = scheduler.schedule()
    assert behind.scheduled_spec_decode_tokens == {"a": [4]} and behind.behind_verify == {"a"}
    scheduler.update_from_output(verify, output(verify, {"a": [4, 1, 2, 3]}))  # all accepted
    assert request.inflight_drafts_follow
    assert scheduler.schedule().num_scheduled_tokens == {}  # 5 outputs, up to 2 in flight: capped
    scheduler.update_from_output(behind, output(behind, {"a": [4, 1]}))
    assert request.is_finished and request.num_output_tokens == 7

    tight = make_scheduler()
    add(tight, "b", max_tokens=6)  # no room for a draft behind the verify step: it waits
    tight.update_from_output(so := tight.schedule(), output(so, {"b": [3]}))
    tight.schedule()
    assert tight.schedule().num_scheduled_tokens == {}


def test_no_step_runs_behind_a_verify_step_whose_sampling_reads_the_history() -> None:
    scheduler = make_scheduler()
    params = SamplingParams(max_tokens=32, ignore_eos=True, repetition_penalty=1.1)
    scheduler.add_request(Request("a", PROMPT, params, eos_token_ids=set()))
    scheduler.update_from_output(so := scheduler.schedule(), output(so, {"a": [3]}))
    assert scheduler.schedule().scheduled_spec_decode_tokens == {"a": [4, 1, 2]}
    assert scheduler.schedule().num_scheduled_tokens == {}  # penalties count the tokens in flight


def test_a_step_behind_a_corrected_step_caches_only_the_kv_of_its_history() -> None:
    """Two steps in a row run behind verify steps that rejected drafts, each corrected one step
    late: the counts end where the history does and only its KV is cached."""
    scheduler = make_scheduler()
    request = add(scheduler, "a", prompt=[7, 8, 4, 9, 5, 6, 1, 2, 3, 4, 1, 2])
    scheduler.update_from_output(so := scheduler.schedule(), output(so, {"a": [3]}))  # 13 tokens
    verify = scheduler.schedule()
    first_behind = scheduler.schedule()
    assert verify.scheduled_spec_decode_tokens == first_behind.scheduled_spec_decode_tokens == {"a": [4, 1, 2]}
    scheduler.update_from_output(verify, output(verify, {"a": [4, 9]}))  # one accepted: 15 tokens
    second_behind = scheduler.schedule()  # guessed to accept nothing: ... 4, 9 drafts 5, 6, 1, 2 less 5
    assert second_behind.behind_verify == {"a"} and second_behind.scheduled_spec_decode_tokens == {"a": [6, 1, 2]}
    scheduler.update_from_output(first_behind, output(first_behind, {"a": [1]}))  # none accepted
    assert request.num_tokens == 16 and request.num_computed_tokens == 15 + 1 + K
    # Tokens 0..14 have their KV: 3 blocks of 4.
    assert scheduler.kv_cache_manager.managers[0].num_cached_blocks["a"] == 3
    scheduler.update_from_output(second_behind, output(second_behind, {"a": [6, 1, 5]}))
    assert request.output_token_ids == [3, 4, 9, 1, 6, 1, 5] and request.num_computed_tokens == request.num_tokens - 1
    scheduler.finish_requests("a", request.status.FINISHED_ABORTED)
    scheduler.schedule()
    scheduler.check_idle()
