"""The engine core in its own process (`EngineCoreClient`), on a tiny random checkpoint: the
same greedy tokens as the in-process core through `LLMEngine`, aborts and parallel samples
ending idle, a refused request that leaves the others running, a dead core reported as such,
and a core that never outlives the process that started it, nor leaves its pipes' directory."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import pytest
import torch

pytest.importorskip("zmq")

from model_utils import save_tiny_checkpoint
from server_utils import is_running, wait_until

from pagoda import SamplingParams
from pagoda.config import EngineConfig
from pagoda.engine.arg_utils import create_engine_config
from pagoda.engine.core_client import EngineCoreClient, EngineDeadError, core_start_method
from pagoda.engine.llm_engine import LLMEngine
from pagoda.errors import InvalidRequestError
from pagoda.outputs import RequestOutput

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], list(range(10, 60)), [42] * 20]
# Deadline for what takes seconds on a quiet machine: only a failing test waits it out.
DEADLINE_S = 300


def config_kwargs(model: str) -> dict[str, Any]:
    # 12 usable blocks of 8 tokens: a request of max_model_len (16 blocks) is refused, and the
    # tests' batches preempt each other, across the process boundary too.
    return {
        "model": model,
        "device": "cpu",
        "dtype": "float32",
        "max_model_len": 128,
        "num_gpu_blocks": 13,
        "block_size": 8,
    }


def make_config(model: str) -> EngineConfig:
    return create_engine_config(**config_kwargs(model))


@pytest.fixture(scope="module")
def remote(tiny_llama3: str):
    """Started as `pagoda serve` starts it: the core builds its config from the arguments."""
    client = EngineCoreClient(config_kwargs(tiny_llama3))
    yield LLMEngine(make_config(tiny_llama3), engine_core=client)
    client.shutdown()
    assert not client.process.is_alive()
    assert not os.path.exists(client.ipc_dir)


def run_to_end(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> list[RequestOutput]:
    ids = [engine.add_request(prompt, params) for prompt in prompts]
    finished: dict[str, RequestOutput] = {}
    deadline = time.monotonic() + DEADLINE_S
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "the engine did not finish in time"
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    return [finished[i] for i in ids]


def test_remote_core_generates_what_the_local_one_does(remote: LLMEngine, tiny_llama3: str) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    local = run_to_end(LLMEngine(make_config(tiny_llama3)), PROMPTS, params)
    outputs = run_to_end(remote, PROMPTS, params)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in local]
    assert all(len(o.outputs[0].token_ids) == 12 for o in outputs)
    assert remote.engine_core.num_kv_blocks == 12  # the core's own config: the same pool
    remote.check_idle()


def test_a_bad_argument_fails_the_core_with_its_message_alone(tiny_llama3: str) -> None:
    client = EngineCoreClient({**config_kwargs(tiny_llama3), "max_model_len": 100_000})
    with pytest.raises(EngineDeadError, match="max_model_len") as failure:
        client.wait_until_ready()
    assert "Traceback" not in str(failure.value)  # a ConfigError, not a crash
    assert not client.process.is_alive()


def test_a_core_still_starting_is_stopped_by_signal_not_asked(tiny_llama3: str) -> None:
    """It reads no command before its model is loaded: a SHUTDOWN would wait for that."""
    client = EngineCoreClient(config_kwargs(tiny_llama3))
    client.shutdown()
    assert client.process.exitcode in (-signal.SIGTERM, 128 + signal.SIGTERM)
    assert not os.path.exists(client.ipc_dir)


def test_parallel_samples_and_aborts_end_idle(remote: LLMEngine) -> None:
    (output,) = run_to_end(remote, [PROMPTS[2]], SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8))
    assert len(output.outputs) == 3 and all(len(c.token_ids) == 8 for c in output.outputs)
    long = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    ids = [remote.add_request(prompt, long) for prompt in PROMPTS]
    remote.step()
    aborted = remote.abort_requests(ids[:2])
    assert [o.outputs[0].finish_reason for o in aborted] == ["abort", "abort"]
    while remote.has_unfinished_requests():
        remote.step()
    remote.check_idle()
    assert remote.engine_core.stats.num_running_reqs == 0
    assert remote.engine_core.stats.kv_cache_usage == 0


def test_a_refused_request_leaves_the_others_running(remote: LLMEngine, tiny_llama3: str) -> None:
    """A request the KV pool cannot hold comes back finished with ERROR and the reason; the
    in-process core refuses the same request when it is added."""
    too_big = remote.add_request(PROMPTS[2], SamplingParams(max_tokens=100))
    fine = remote.add_request(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    finished: dict[str, RequestOutput] = {}
    while remote.has_unfinished_requests():
        finished.update({o.request_id: o for o in remote.step() if o.finished})
    assert finished[too_big].outputs[0].finish_reason == "error"
    assert "KV cache blocks" in finished[too_big].outputs[0].error
    assert "KV cache blocks" in remote.engine_core.request_errors.pop(too_big)
    assert len(finished[fine].outputs[0].token_ids) == 5
    remote.check_idle()
    with pytest.raises(InvalidRequestError, match="KV cache blocks"):
        LLMEngine(make_config(tiny_llama3)).add_request(PROMPTS[2], SamplingParams(max_tokens=100))


def test_a_dead_core_is_reported(remote: LLMEngine) -> None:
    """Last of the module's tests on `remote`: it kills its core."""
    client = remote.engine_core
    remote.add_request(PROMPTS[0], SamplingParams(max_tokens=60, ignore_eos=True))
    os.kill(client.process.pid, signal.SIGKILL)
    with pytest.raises(EngineDeadError, match="exit code -9"):
        while remote.has_unfinished_requests():
            remote.step()
    with pytest.raises(EngineDeadError, match="exit code -9"):
        client.check_alive()
    with pytest.raises(EngineDeadError):
        remote.add_request(PROMPTS[1], SamplingParams(max_tokens=4))


def test_the_core_dies_with_its_parent(tiny_llama3: str) -> None:
    """A parent killed outright (no shutdown, no exit handlers) leaves no core behind, and no
    directory of the core's pipes."""
    script = (
        "import signal\n"
        "from pagoda.engine.arg_utils import create_engine_config\n"
        "from pagoda.engine.core_client import EngineCoreClient\n"
        f"config = create_engine_config(model={tiny_llama3!r}, device='cpu', dtype='float32', num_gpu_blocks=16)\n"
        "client = EngineCoreClient(config)\n"
        "client.wait_until_ready()\n"
        "print(client.process.pid, client.ipc_dir, client.start_method, flush=True)\n"
        "signal.pause()\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        core_pid, ipc_dir, start_method = parent.stdout.readline().split()
        assert is_running(int(core_pid)) and os.path.isdir(ipc_dir)
        # A process with one thread and no CUDA forks its core (as `pagoda serve` does).
        assert start_method == "fork"
        parent.kill()
        parent.wait(DEADLINE_S)
        assert wait_until(lambda: not is_running(int(core_pid)), DEADLINE_S), "the core outlived its parent"
        assert not os.path.exists(ipc_dir), "the core left its pipes' directory behind"
    finally:
        parent.kill()
        parent.wait(DEADLINE_S)


def test_sleep_wake_and_weight_updates_run_in_the_core(tiny_llama3: str, tmp_path) -> None:
    """Utility calls cross the process boundary: their errors come back as exceptions with the
    core's message (the core serves on), and greedy output after each wake-up is the same."""
    config = create_engine_config(
        model=tiny_llama3,
        device="cpu",
        dtype="float32",
        max_model_len=128,
        num_gpu_blocks=13,
        block_size=8,
        enable_sleep_mode=True,
    )
    client = EngineCoreClient(config)
    engine = LLMEngine(config, engine_core=client)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    try:
        before = [o.outputs[0].token_ids for o in run_to_end(engine, PROMPTS[:2], greedy)]
        assert client.is_sleeping() is False
        busy = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=60, ignore_eos=True))
        with pytest.raises(RuntimeError, match="cannot sleep while the engine is busy"):
            client.sleep(1)
        engine.abort_requests([busy])
        with pytest.raises(ValueError, match="sleep level must be 1 or 2"):
            client.sleep(3)
        with pytest.raises(ValueError, match="unknown engine core utility 'shutdown'"):
            client.call_utility("shutdown")

        client.sleep(1)
        assert client.is_sleeping() is True
        (refused,) = run_to_end(engine, [PROMPTS[1]], greedy)
        assert refused.outputs[0].finish_reason == "error" and "sleeping" in refused.outputs[0].error
        with pytest.raises(ValueError, match="unknown sleep tag 'gpu'"):
            client.wake_up(["gpu"])
        client.wake_up(["kv_cache"])
        assert client.is_sleeping() is True
        client.wake_up(["weights"])
        assert client.is_sleeping() is False
        assert [o.outputs[0].token_ids for o in run_to_end(engine, PROMPTS[:2], greedy)] == before

        client.sleep(2)  # weights dropped: wake_up reloads them from the checkpoint
        client.wake_up()
        assert [o.outputs[0].token_ids for o in run_to_end(engine, PROMPTS[:2], greedy)] == before
        engine.check_idle()

        negated = str(tmp_path / "negated")
        hf_model = save_tiny_checkpoint("llama3", negated)
        with torch.no_grad():
            for parameter in hf_model.parameters():
                parameter.neg_()
        hf_model.save_pretrained(negated)
        expected = [o.outputs[0].token_ids for o in run_to_end(LLMEngine(make_config(negated)), PROMPTS[:2], greedy)]
        assert expected != before
        client.update_weights(negated)
        assert [o.outputs[0].token_ids for o in run_to_end(engine, PROMPTS[:2], greedy)] == expected
        with pytest.raises(ValueError, match=r"no \*.safetensors weights"):
            client.update_weights(str(tmp_path / "missing"))
        assert client.process.is_alive()
    finally:
        client.shutdown()


def test_the_core_forks_only_where_that_is_safe(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fork copies one thread: with other threads alive (a lock one holds would stay held in the
    copy) the core is spawned, and a CUDA engine's always (this process's CUDA driver would be
    unusable in the copy); the environment variable overrides, and a wrong value is named."""
    monkeypatch.delenv("PAGODA_CORE_START_METHOD", raising=False)
    release = threading.Event()
    other = threading.Thread(target=release.wait)
    other.start()
    try:
        assert core_start_method("cpu") == "spawn"
    finally:
        release.set()
        other.join()
    if threading.active_count() == 1:  # pytest-xdist's workers keep threads of their own
        assert core_start_method("cpu") == "fork"
    assert core_start_method("cuda") == core_start_method("auto") == core_start_method(None) == "spawn"
    monkeypatch.setenv("PAGODA_CORE_START_METHOD", "spawn")
    assert core_start_method("cpu") == "spawn"
    monkeypatch.setenv("PAGODA_CORE_START_METHOD", "forkserver")
    with pytest.raises(ValueError, match="PAGODA_CORE_START_METHOD must be fork or spawn"):
        core_start_method("cpu")


def test_a_forked_core_generates_what_the_in_process_core_does(tiny_llama3: str) -> None:
    """The fork path end to end, from a fresh process (this one may have threads): the same
    greedy tokens as the in-process core, and a clean shutdown."""
    script = (
        "from pagoda import SamplingParams\n"
        "from pagoda.engine.arg_utils import create_engine_config\n"
        "from pagoda.engine.core_client import EngineCoreClient\n"
        "from pagoda.engine.llm_engine import LLMEngine\n"
        f"config = create_engine_config(**{config_kwargs(tiny_llama3)!r})\n"
        "client = EngineCoreClient(config)\n"
        "engine = LLMEngine(config, engine_core=client)\n"
        "greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)\n"
        f"ids = [engine.add_request(prompt, greedy) for prompt in {PROMPTS!r}]\n"
        "finished = {}\n"
        "while engine.has_unfinished_requests():\n"
        "    finished.update((o.request_id, o.outputs[0].token_ids) for o in engine.step() if o.finished)\n"
        "client.shutdown()\n"
        "print(client.start_method, client.process.exitcode, [finished[i] for i in ids])\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=DEADLINE_S)
    assert result.returncode == 0, result.stderr
    start_method, exitcode, tokens = result.stdout.strip().splitlines()[-1].split(" ", 2)
    assert (start_method, exitcode) == ("fork", "0")
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    local = [o.outputs[0].token_ids for o in run_to_end(LLMEngine(make_config(tiny_llama3)), PROMPTS, greedy)]
    assert tokens == repr(local)
