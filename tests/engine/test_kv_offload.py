"""CPU offload of the KV cache (#17) end to end on the CPU, on a tiny random Llama.

A multi-turn chat whose working set is 5x the device pool: with offload on, the blocks each
turn's history evicted come back from the host pool (every reusable block of the previous
turn is hit, on the device or on the host), and the tokens equal those of offload off.
Then: tenants' salts isolate the host pool too; an abort while a load is in flight, an
injected load failure (the load writes NaN into its blocks) and a load timeout all end with
the same tokens and a whole pool on both sides (the autouse idle check).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.config import ConfigError
from pagoda.kv_transfer.factory import block_bytes
from pagoda.metrics import ServerMetrics
from pagoda.outputs import RequestStatus

BLOCK_SIZE = 4
NUM_GPU_BLOCKS = 24  # 23 usable: 92 tokens
NUM_CONVERSATIONS = 7
NUM_TURNS = 5
TURN_TOKENS = 12
ANSWER_TOKENS = 2
NUM_HOST_BLOCKS = 160
GREEDY = SamplingParams(temperature=0.0, max_tokens=ANSWER_TOKENS, ignore_eos=True)


def make_llm(path: str, offload: bool = True, **kwargs) -> LLM:
    # A CUDA target's `device` replaces the CPU default (found on the H200: it was passed twice).
    settings = {
        "model": path,
        "device": "cpu",
        "dtype": "float32",
        "max_model_len": 128,
        "block_size": BLOCK_SIZE,
        "num_gpu_blocks": NUM_GPU_BLOCKS,
        **kwargs,
    }
    if offload:
        # Sized from a plain engine's block: the tiny model's block is 2 KiB over both layers.
        settings["kv_offload_gib"] = NUM_HOST_BLOCKS * 2048 / 2**30
    return LLM(**settings)


def chat(llm: LLM, seed: int = 0) -> tuple[list[list[int]], int]:
    """Turn by turn, each conversation's history plus a new user turn, one request at a time:
    the tokens answered, and the reusable prefix tokens (the previous turn's full computed
    blocks of the same conversation) summed over requests."""
    rng = random.Random(seed)
    histories = [[rng.randrange(3, 250) for _ in range(TURN_TOKENS)] for _ in range(NUM_CONVERSATIONS)]
    answers, reusable = [], 0
    for turn in range(NUM_TURNS):
        for c in range(NUM_CONVERSATIONS):
            (output,) = llm.generate([histories[c]], GREEDY, use_tqdm=False)
            tokens = output.outputs[0].token_ids
            answers.append(tokens)
            if turn:
                reusable += (len(histories[c]) - TURN_TOKENS - 1) // BLOCK_SIZE * BLOCK_SIZE
            histories[c] = histories[c] + tokens + [rng.randrange(3, 250) for _ in range(TURN_TOKENS)]
    return answers, reusable


def batched_chat(llm: LLM, seed: int = 1, turns: int = 3) -> list[list[int]]:
    """The same chat with every conversation's turn submitted at once: requests preempt each
    other (the pool holds about one history) while others wait for loads."""
    rng = random.Random(seed)
    histories = [[rng.randrange(3, 250) for _ in range(TURN_TOKENS)] for _ in range(NUM_CONVERSATIONS)]
    answers = []
    for _ in range(turns):
        outputs = llm.generate(histories, GREEDY, use_tqdm=False)
        for c, output in enumerate(outputs):
            tokens = output.outputs[0].token_ids
            answers.append(tokens)
            histories[c] = histories[c] + tokens + [rng.randrange(3, 250) for _ in range(TURN_TOKENS)]
    return answers


@pytest.mark.parametrize(
    "settings, preempts",
    [({}, True), ({"max_num_batched_tokens": 16}, False), ({"kv_offload_prompts_first": True}, True)],
    ids=["default", "full-steps", "prompts-first"],
)
def test_batched_chat_with_preemption_matches_offload_off(tiny_llama3: str, settings: dict, preempts: bool) -> None:
    """With a 16-token step budget every prefill step is full, so loads start ahead of it
    (and requests, each prefilled over steps, no longer preempt each other); with prompts
    first, decoding requests are swapped out for the waiting prompts and resume from the host."""
    expected = batched_chat(make_llm(tiny_llama3, offload=False))
    llm = make_llm(tiny_llama3, async_scheduling=True, **settings)
    assert batched_chat(llm) == expected
    figures = stats(llm)
    assert (figures.num_preemptions > 0) == preempts and figures.kv_transfer.hit_tokens > 0


def stats(llm: LLM):
    return llm.llm_engine.engine_core.scheduler.make_stats()


def worker_connector(llm: LLM):
    return llm.llm_engine.engine_core.executor.worker.model_runner.kv_connector


@pytest.fixture(scope="module")
def reference(tiny_llama3: str) -> Callable[[str], tuple[list[list[int]], int]]:
    """The chat's answers and reusable tokens with offload off, on `device` (computed once each)."""
    cache: dict[str, tuple[list[list[int]], int]] = {}

    def run(device: str) -> tuple[list[list[int]], int]:
        if device not in cache:
            llm = make_llm(tiny_llama3, offload=False, **TARGETS[device])
            answers, reusable = chat(llm)
            assert stats(llm).prefix_cache_hits < reusable / 2  # the pool is too small to keep the histories
            cache[device] = answers, reusable
            llm.shutdown()
        return cache[device]

    return run


# Engine settings per device: float32 on both (the CUDA run uses the Triton attention backend).
TARGETS = {"cpu": {}, "cuda": {"device": "cuda", "attention_backend": "triton"}}


@pytest.mark.parametrize(
    "device, async_scheduling, save_on_finish",
    [
        ("cpu", False, False),
        ("cpu", True, False),
        ("cpu", False, True),
        pytest.param("cuda", True, False, marks=pytest.mark.gpu),
        pytest.param("cuda", False, True, marks=pytest.mark.gpu),
    ],
    ids=["sync", "async", "finish", "cuda-async", "cuda-finish"],
)
def test_multi_turn_chat_hits_the_host_pool(
    tiny_llama3: str, reference, device: str, async_scheduling: bool, save_on_finish: bool
) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    llm = make_llm(
        tiny_llama3, async_scheduling=async_scheduling, kv_offload_save_on_finish=save_on_finish, **TARGETS[device]
    )
    assert block_bytes(llm.llm_engine.engine_core.executor.worker.model_runner.kv_cache_config) == 2048
    answers, reusable = chat(llm)
    assert (answers, reusable) == reference(device)
    figures = stats(llm)
    transfer = figures.kv_transfer
    assert transfer.hit_tokens > reusable / 2  # most of the history comes from the host
    assert figures.prefix_cache_hits + transfer.hit_tokens == reusable  # and nothing reusable is recomputed
    assert transfer.num_loads > 0 and transfer.load_bytes == transfer.hit_tokens // BLOCK_SIZE * 2048
    assert transfer.num_failed_transfers == 0
    index = llm.llm_engine.engine_core.scheduler.remote_kv.connector.index
    assert 0 < index.num_cached <= NUM_HOST_BLOCKS
    metrics = ServerMetrics()
    metrics.observe_scheduler(figures)
    text = metrics.render().decode()
    assert f"pagoda:kv_offload_hit_tokens_total {float(transfer.hit_tokens)}" in text
    assert f'pagoda:kv_transfer_bytes_total{{direction="load"}} {float(transfer.load_bytes)}' in text


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def llm(tiny_llama3: str, request) -> LLM:
    """One engine with offload for the scenario tests below, on the CPU (and with -m gpu on CUDA,
    where the injected load delay is a device sleep on the load stream)."""
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    engine = make_llm(tiny_llama3, **TARGETS[request.param])
    yield engine
    engine.shutdown()


def evict_to_host(llm: LLM, prompt: list[int], salt: str | None = None) -> list[int]:
    """Answer `prompt`, then push its blocks out of the device pool with other prompts."""
    (output,) = llm.generate([prompt], GREEDY, use_tqdm=False, cache_salt=salt)
    rng = random.Random(len(prompt) * 7919 + sum(prompt))
    for _ in range(3):
        llm.generate([[rng.randrange(3, 250) for _ in range(40)]], GREEDY, use_tqdm=False)
    return output.outputs[0].token_ids


def host_hits(llm: LLM, prompt: list[int], salt: str | None = None) -> tuple[int, list[int]]:
    before = stats(llm).kv_transfer.hit_tokens
    (output,) = llm.generate([prompt], GREEDY, use_tqdm=False, cache_salt=salt)
    return stats(llm).kv_transfer.hit_tokens - before, output.outputs[0].token_ids


def test_cache_salt_isolates_tenants_in_the_host_pool(llm: LLM) -> None:
    prompt = list(range(5, 46))  # 41 tokens: 10 blocks may hit
    tokens = evict_to_host(llm, prompt, salt="tenant-a")
    assert host_hits(llm, prompt, salt="tenant-b") == (0, tokens)
    assert host_hits(llm, prompt) == (0, tokens)
    evict_to_host(llm, [1, 2, 3])
    assert host_hits(llm, prompt, salt="tenant-a") == (40, tokens)


def run_until_loading(llm: LLM, prompt: list[int]) -> str:
    engine = llm.llm_engine
    req_id = engine.add_request(prompt, GREEDY)
    scheduler = engine.engine_core.scheduler
    for _ in range(4):
        engine.step()
        if scheduler.requests[req_id].status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            return req_id
    raise AssertionError("the request never waited for its KV")


def test_abort_while_loading_frees_the_blocks_after_the_load(llm: LLM) -> None:
    prompt = list(range(60, 101))
    tokens = evict_to_host(llm, prompt)
    faults = worker_connector(llm).faults
    faults.load_delay_s = 0.3
    try:
        req_id = run_until_loading(llm, prompt)
        engine = llm.llm_engine
        engine.abort_requests([req_id])
        remote_kv = engine.engine_core.scheduler.remote_kv
        assert f"{req_id}:load" in remote_kv.held  # the copy still writes into them
        deadline = time.monotonic() + 10
        while engine.has_unfinished_requests() and time.monotonic() < deadline:
            engine.step()
        assert not remote_kv.held
    finally:
        faults.load_delay_s = 0.0
    assert host_hits(llm, prompt) == (40, tokens)  # the host copy is still good


def test_failed_load_recomputes(llm: LLM) -> None:
    prompt = list(range(110, 151))
    tokens = evict_to_host(llm, prompt)
    before = stats(llm).kv_transfer.num_failed_transfers
    worker_connector(llm).faults.fail_loads = 1  # it fills its blocks with NaN bytes
    assert host_hits(llm, prompt) == (0, tokens)
    assert stats(llm).kv_transfer.num_failed_transfers == before + 1
    device_hits = stats(llm).prefix_cache_hits
    assert host_hits(llm, prompt) == (0, tokens)  # the recomputed blocks serve the next run
    assert stats(llm).prefix_cache_hits - device_hits == 40


def test_load_timeout_recomputes(tiny_llama3: str) -> None:
    llm = make_llm(tiny_llama3, kv_load_timeout_s=0.05)
    prompt = list(range(150, 191))
    tokens = evict_to_host(llm, prompt)
    worker_connector(llm).faults.load_delay_s = 0.3
    assert host_hits(llm, prompt) == (0, tokens)
    worker_connector(llm).faults.load_delay_s = 0.0


@pytest.mark.parametrize(
    "settings, match",
    [
        ({"kv_offload_gib": -1.0}, "kv_offload_gib must be >= 0"),
        ({"kv_offload_gib": 1.0, "enable_prefix_caching": False}, "kv_offload_gib needs prefix caching"),
        ({"kv_offload_gib": 1e-9}, "kv_offload_gib 1e-09 holds no block"),
        ({"kv_load_timeout_s": 0.0}, "kv_load_timeout_s must be > 0"),
        ({"kv_offload_prompts_first": True}, "kv_offload_prompts_first needs kv_offload_gib"),
    ],
)
def test_bad_offload_settings_name_the_field(tiny_llama3: str, settings: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        LLM(model=tiny_llama3, device="cpu", num_gpu_blocks=8, **settings)


def test_offload_needs_one_full_attention_group(tmp_path) -> None:
    from model_utils import save_tiny_checkpoint

    save_tiny_checkpoint("qwen2-sliding", str(tmp_path))
    with pytest.raises(ConfigError, match="kv_offload_gib needs one full-attention KV-cache group"):
        LLM(model=str(tmp_path), device="cpu", num_gpu_blocks=8, kv_offload_gib=0.01)
