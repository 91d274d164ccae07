"""Aborts in every request state, on a tiny random checkpoint.

A request aborted while waiting, mid chunked prefill, decoding, preempted, or finished in
the core but not yet drained by the client (n = 1 and n = 3; through `LLMEngine`, over a
core process, and through `AsyncLLM` streaming and not) stops at once: its core requests
leave the scheduler and give back their blocks before the next step, it produces no output
after its final "abort" one, the other request finishes with the tokens it gets alone, and
the engine ends idle. Aborts of unknown or already finished ids are dropped everywhere.
The conftest idle check that runs after every engine test is itself shown to catch a leak.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from engine_utils import check_engine_idle

from pagoda import SamplingParams
from pagoda.config import EngineConfig
from pagoda.engine.arg_utils import create_engine_config
from pagoda.engine.llm_engine import LLMEngine
from pagoda.outputs import RequestOutput, RequestStatus

PROMPT = list(range(1, 31))  # 30 tokens: 3 full blocks of 8, then a partial one
OTHER_PROMPT = list(range(100, 118))
STATES = ["waiting", "mid-prefill", "decoding", "preempted"]


def make_config(model: str, **overrides) -> EngineConfig:
    # 12 usable blocks of 8 tokens, 16 tokens a step: two requests of 30 + 40 tokens cannot
    # both hold their blocks (preemption), and a 30-token prompt takes two steps (chunked prefill).
    kwargs = {
        "device": "cpu",
        "dtype": "float32",
        "max_model_len": 128,
        "num_gpu_blocks": 13,
        "block_size": 8,
        "max_num_batched_tokens": 16,
    }
    return create_engine_config(model=model, **{**kwargs, **overrides})


def params(n: int, max_tokens: int = 40) -> SamplingParams:
    return SamplingParams(n=n, temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def run_alone(model: str, prompt: list[int], max_tokens: int) -> list[int]:
    engine = LLMEngine(make_config(model))
    engine.add_request(prompt, params(1, max_tokens))
    return drain(engine)[0].outputs[0].token_ids


def drain(engine: LLMEngine, deadline_s: float = 60) -> list[RequestOutput]:
    """Step until nothing is in flight; returns the finished outputs."""
    finished = []
    deadline = time.monotonic() + deadline_s
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "the engine did not drain in time"
        finished += [output for output in engine.step() if output.finished]
    return finished


def core_ids(engine: LLMEngine, request_id: str) -> list[str]:
    return engine.output_processor.core_request_ids([request_id])


def reached(engine: LLMEngine, victim: str, state: str) -> bool:
    scheduler = engine.engine_core.scheduler
    requests = [scheduler.requests.get(core_id) for core_id in core_ids(engine, victim)]
    first = requests[0]
    if first is None:
        pytest.fail(f"{victim} finished before reaching state {state}")
    if state == "waiting":
        return first.status == RequestStatus.WAITING and scheduler.num_running == 1
    if state == "mid-prefill":
        return 0 < first.num_computed_tokens < first.num_prompt_tokens
    if state == "decoding":
        return first.num_output_tokens >= 2
    return any(request is not None and request.status == RequestStatus.PREEMPTED for request in requests)


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("state", STATES)
def test_abort_in_every_state_frees_its_blocks_at_once(tiny_llama3: str, state: str, n: int) -> None:
    engine = LLMEngine(make_config(tiny_llama3, **({"max_num_seqs": 1} if state == "waiting" else {})))
    scheduler = engine.engine_core.scheduler
    kv = scheduler.kv_cache_manager
    # The victim goes first where it must be the one computing, last where it must wait or be preempted.
    victim_first = state in ("mid-prefill", "decoding")
    other = None if victim_first else engine.add_request(OTHER_PROMPT, params(1))
    victim = engine.add_request(PROMPT, params(n))
    other = other or engine.add_request(OTHER_PROMPT, params(1))
    outputs_of_victim = 0
    for _ in range(200):
        outputs_of_victim += sum(o.request_id == victim for o in engine.step())
        if reached(engine, victim, state):
            break
    else:
        pytest.fail(f"never reached state {state}")

    victim_core_ids = core_ids(engine, victim)
    (final,) = engine.abort_requests([victim])
    assert final.finished and [c.finish_reason for c in final.outputs] == ["abort"] * n
    for core_id in victim_core_ids:
        assert core_id not in scheduler.requests and all(
            core_id not in manager.req_to_blocks for manager in kv.managers
        )
    assert all(set(manager.req_to_blocks) <= {other} for manager in kv.managers), (
        "only the other request may hold blocks now"
    )
    assert not engine.output_processor.has_request(victim)
    assert engine.abort_requests([victim, "no-such-request"]) == []  # again, and unknown: dropped
    finished = drain(engine)
    assert [o.request_id for o in finished] == [other], "the victim produced output after its abort"
    assert finished[0].outputs[0].token_ids == run_alone(tiny_llama3, OTHER_PROMPT, 40)
    engine.check_idle()


@pytest.mark.parametrize("n", [1, 3])
def test_abort_after_the_core_finished_but_before_the_output_was_drained(tiny_llama3: str, n: int) -> None:
    """Over a core process: the core finishes the request and reports it, the client aborts
    before reading the report; the core drops the abort, the client drops the late output."""
    EngineCoreClient = pytest.importorskip("pagoda.engine.core_client").EngineCoreClient  # needs pyzmq

    config = make_config(tiny_llama3)
    client = EngineCoreClient(config)
    try:
        engine = LLMEngine(config, engine_core=client)
        request_id = engine.add_request(PROMPT, params(n, max_tokens=3))
        parent = engine.output_processor.parent_requests.get(request_id)
        deadline = time.monotonic() + 60
        while parent is not None and parent._waiting:  # samples 1..n-1 join after sample 0's first token
            assert time.monotonic() < deadline
            engine.step()
        while client.num_commands_applied < client.num_commands_sent or client._core_has_work:
            assert time.monotonic() < deadline
            client._receive(block=True)  # the core's reports are read, not drained into outputs
        assert engine.output_processor.has_request(request_id), "drained before the abort"
        # Under load sample 0 can finish (and be drained) while its siblings wait to join: those
        # keep their own finish reason; every sample still in flight is aborted.
        already_done = {c.index for c in parent.completions if c.finished} if parent is not None else set()
        (final,) = engine.abort_requests([request_id])
        assert [c.finish_reason for c in final.outputs if c.index not in already_done] == ["abort"] * (
            n - len(already_done)
        )
        assert len(already_done) < n
        assert drain(engine) == []  # the core's final outputs arrive and are dropped
        engine.check_idle()
    finally:
        client.shutdown()


def test_unknown_ids_are_dropped_by_every_layer(tiny_llama3: str) -> None:
    engine = LLMEngine(make_config(tiny_llama3))
    scheduler = engine.engine_core.scheduler
    scheduler.finish_requests(["nobody"], RequestStatus.FINISHED_STOPPED)
    scheduler.abort_requests("nobody")
    assert engine.output_processor.abort_requests(["nobody"]) == []
    processed = engine.output_processor.process_outputs([])
    assert processed.outputs == [] and processed.failed == []
    done = engine.add_request(PROMPT, params(1, max_tokens=2))
    drain(engine)
    assert engine.abort_requests([done, "nobody"]) == []
    engine.check_idle()


def test_the_idle_fixture_catches_a_leaked_block(tiny_llama3: str) -> None:
    engine = LLMEngine(make_config(tiny_llama3))
    engine.add_request(PROMPT, params(1, max_tokens=2))
    drain(engine)
    pool = engine.engine_core.scheduler.kv_cache_manager.block_pool
    (leaked,) = pool.get_new_blocks(1)
    with pytest.raises(AssertionError, match="still have references"):
        check_engine_idle(engine)
    pool.free_blocks([leaked])
    check_engine_idle(engine)


# ---- through AsyncLLM: streaming and not, cancelled and explicitly aborted ------------------


async def consume(llm, request_id: str, stream: bool, leave_after: int | None) -> RequestOutput | None:
    """Read a request's outputs (all, or only the last when not streaming); leave after
    `leave_after` outputs (0: before the first)."""
    outputs = llm.outputs(request_id)
    last, count = None, 0
    async for output in outputs:
        count += 1
        if stream or output.finished:
            last = output
        if leave_after is not None and count >= leave_after:
            break
    await outputs.aclose()
    return last


def test_async_aborts_in_every_mode_end_idle(tiny_llama3: str) -> None:
    AsyncLLM = pytest.importorskip("pagoda.engine.async_llm").AsyncLLM  # needs pyzmq

    expected = run_alone(tiny_llama3, OTHER_PROMPT, 40)
    llm = AsyncLLM(make_config(tiny_llama3))

    async def scenario(n: int, stream: bool, how: str) -> None:
        victim, other = f"victim-{n}-{stream}-{how}", f"other-{n}-{stream}-{how}"
        llm.add_requests([(OTHER_PROMPT, params(1), other), (PROMPT, params(n), victim)])
        other_task = asyncio.create_task(consume(llm, other, stream, None))
        if how == "abort-before-any-output":
            llm.abort([victim])
            assert llm.engine.abort_requests([victim]) == []
        elif how == "cancel-mid-stream":
            task = asyncio.create_task(consume(llm, victim, stream, None))
            while llm.client.num_core_steps < 3:
                await asyncio.sleep(0.01)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        else:  # the reader walks away after two outputs
            await consume(llm, victim, stream, 2)
        llm.abort([victim, "nobody"])  # again, and unknown: dropped
        assert victim not in llm._streams
        other_output = await other_task
        assert other_output.finished and other_output.outputs[0].token_ids == expected
        assert await llm.check_idle() is None, (n, stream, how)

    async def main() -> None:
        for n in (1, 3):
            for stream in (True, False):
                for how in ("abort-before-any-output", "cancel-mid-stream", "leave-after-two"):
                    await scenario(n, stream, how)
        await llm.shutdown()

    try:
        asyncio.run(main())
    finally:
        llm.client.shutdown()
