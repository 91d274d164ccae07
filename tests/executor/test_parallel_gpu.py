"""Tensor and pipeline parallelism on 2 (and 4) GPUs, through the multiprocess executor.

With CUDA's defaults (Triton attention, CUDA graphs with the all-reduce captured, async
scheduling): TP=2, TP=4 and PP=2 give greedy output identical to one GPU in float32, on a
tiny checkpoint and on the Qwen3-0.6B shape with dummy weights; in bf16 the logprobs of the
first tokens stay close. A killed rank (its peers stuck in an NCCL collective) fails the
engine within 10 s and leaves no process behind.
"""

from __future__ import annotations

import os
import random
import signal
import time

import pytest
import torch
from model_utils import save_tiny_checkpoint
from parallel_utils import FAILURE_DEADLINE_S, GenerationUntilFailure
from server_utils import is_running

from pagoda import LLM, SamplingParams
from pagoda.engine.errors import EngineDeadError

pytestmark = pytest.mark.gpu

NUM_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
SPLITS = [
    pytest.param((2, 1), id="tp2", marks=pytest.mark.skipif(NUM_GPUS < 2, reason="needs 2 GPUs")),
    pytest.param((1, 2), id="pp2", marks=pytest.mark.skipif(NUM_GPUS < 2, reason="needs 2 GPUs")),
    pytest.param((4, 1), id="tp4", marks=pytest.mark.skipif(NUM_GPUS < 4, reason="needs 4 GPUs")),
    pytest.param((2, 2), id="tp2xpp2", marks=pytest.mark.skipif(NUM_GPUS < 4, reason="needs 4 GPUs")),
]
ENGINE = {"max_model_len": 128, "num_gpu_blocks": 512, "max_num_seqs": 16, "max_cudagraph_capture_size": 64}


def prompts(count: int = 8, vocab: int = 256) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(1, vocab) for _ in range(rng.randint(1, 60))] for _ in range(count)]


def run(llm: LLM, prompt_ids: list[list[int]], max_tokens: int, logprobs: int | None = None):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)
    return [output.outputs[0] for output in llm.generate(prompt_ids, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[str, list[list[int]]]:
    path = str(tmp_path_factory.mktemp("qwen3"))
    save_tiny_checkpoint("qwen3", path)
    llm = LLM(path, dtype="float32", **ENGINE)
    reference = [out.token_ids for out in run(llm, prompts(), 24)]
    llm.shutdown()
    return path, reference


@pytest.mark.parametrize("split", SPLITS)
def test_tiny_checkpoint_split_matches_one_gpu(start_llm, tiny, split) -> None:
    path, reference = tiny
    tp, pp = split
    llm = start_llm(path, dtype="float32", tensor_parallel_size=tp, pipeline_parallel_size=pp, **ENGINE)
    assert llm.llm_engine.config.scheduler_config.async_scheduling
    assert [out.token_ids for out in run(llm, prompts(), 24)] == reference
    llm.llm_engine.check_idle()


@pytest.mark.skipif(NUM_GPUS < 2, reason="needs 2 GPUs")
def test_tiny_checkpoint_tp2_over_nccl_only_matches_one_gpu(start_llm, tiny) -> None:
    """The same split with every all-reduce on NCCL (the one-shot kernel off)."""
    path, reference = tiny
    llm = start_llm(path, dtype="float32", tensor_parallel_size=2, disable_custom_all_reduce=True, **ENGINE)
    assert [out.token_ids for out in run(llm, prompts(), 24)] == reference


@pytest.fixture(scope="module")
def qwen3_reference() -> dict[str, list]:
    """One GPU's greedy outputs on the Qwen3-0.6B shape (dummy weights), float32 and bf16."""
    reference = {}
    for dtype in ("float32", "bfloat16"):
        llm = LLM("qwen3-0.6b", load_format="dummy", dtype=dtype, **ENGINE)
        reference[dtype] = run(llm, prompts(vocab=150000), 16, logprobs=2)
        llm.shutdown()
    return reference


@pytest.mark.parametrize("split", SPLITS)
def test_dummy_qwen3_split_matches_one_gpu(start_llm, qwen3_reference, split) -> None:
    tp, pp = split
    for dtype in ("float32", "bfloat16"):
        llm = start_llm(
            "qwen3-0.6b", load_format="dummy", dtype=dtype, tensor_parallel_size=tp, pipeline_parallel_size=pp, **ENGINE
        )
        outputs = run(llm, prompts(vocab=150000), 16, logprobs=2)
        llm.shutdown()  # before the next dtype's engine takes the GPUs
        for ours, ref in zip(outputs, qwen3_reference[dtype], strict=True):
            if dtype == "float32":
                assert ours.token_ids == ref.token_ids
            # The first token's logprobs (same prompt, same weights): close in any dtype.
            first, first_ref = ours.logprobs[0], ref.logprobs[0]
            token = ref.token_ids[0]
            tolerance = 1e-4 if dtype == "float32" else 0.05
            assert abs(first[token].logprob - first_ref[token].logprob) < tolerance


@pytest.mark.skipif(NUM_GPUS < 2, reason="needs 2 GPUs")
def test_killed_rank_fails_the_engine_within_10_s(start_llm, tiny) -> None:
    path, _ = tiny
    llm = start_llm(path, dtype="float32", tensor_parallel_size=2, **ENGINE)
    pids = [process.pid for process in llm.llm_engine.engine_core.executor.processes]
    generation = GenerationUntilFailure(lambda: run(llm, prompts() * 30, 200))
    generation.wait_in_flight(llm)
    os.kill(pids[1], signal.SIGKILL)
    killed_at = time.monotonic()
    error = generation.wait(FAILURE_DEADLINE_S)
    print(f"engine failed {time.monotonic() - killed_at:.2f} s after the kill")
    assert isinstance(error, EngineDeadError), error
    llm.shutdown()
    assert not [pid for pid in pids if is_running(pid)], "a worker process outlived the engine"
