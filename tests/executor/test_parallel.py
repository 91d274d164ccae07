"""Tensor and pipeline parallelism on the CPU (gloo), through the multiprocess executor.

Every split must give greedy output token-identical to a single rank in float32: TP=2, PP=2
and TP=2 x PP=2 on a tiny Llama; TP=2 x PP=2 on tiny checkpoints with biases and tied
embeddings and with Qwen3's q/k norms; sync and async scheduling; TP=3 on a model whose 9
heads do not split evenly. A worker killed mid-generation fails the engine within seconds and
leaves no process behind.
"""

from __future__ import annotations

import itertools
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from model_utils import TINY_CONFIGS, save_random_checkpoint, save_tiny_checkpoint
from parallel_utils import ENGINE, FAILURE_DEADLINE_S, GenerationUntilFailure, greedy, make_prompts
from server_utils import is_running
from transformers import LlamaConfig

from pagoda import LLM, SamplingParams
from pagoda.config import ConfigError
from pagoda.distributed.parallel_state import get_pp_layer_range, init_parallel_state
from pagoda.engine.arg_utils import create_engine_config
from pagoda.engine.errors import EngineDeadError
from pagoda.model.loader.dummy import checkpoint_shapes, init_dummy_weights
from pagoda.model.registry import get_model_class

NEW_TOKENS = 10


def sampled(llm: LLM, prompts: list) -> list[tuple[list[int], list[dict[int, float] | None]]]:
    """Seeded random samples, and the logprobs of each sampled token's top 2 and of each prompt
    token's top 1: every rank must sample alike (same logits, same seeds) for a split to match."""
    params = SamplingParams(temperature=0.8, top_k=20, seed=7, max_tokens=6, logprobs=2, prompt_logprobs=1)
    results = []
    for out in llm.generate(prompts, params, use_tqdm=False):
        entries = out.prompt_logprobs + out.outputs[0].logprobs
        logprobs = [None if e is None else {t: lp.logprob for t, lp in e.items()} for e in entries]
        results.append((out.outputs[0].token_ids, logprobs))
    return results


def assert_same_samples(ours: list[tuple], reference: list[tuple]) -> None:
    """The same tokens and top tokens; logprobs equal up to float32 summation order."""
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(ours, reference, strict=True):
        assert tokens == ref_tokens
        for entry, ref_entry in zip(logprobs, ref_logprobs, strict=True):
            assert (entry is None) == (ref_entry is None)
            if entry is not None:
                assert entry.keys() == ref_entry.keys()
                assert all(abs(entry[t] - ref_entry[t]) < 1e-4 for t in entry)


@pytest.fixture(scope="module")
def checkpoint(request, tmp_path_factory) -> tuple[str, list[list[int]], list[tuple]]:
    """A tiny checkpoint and its single-rank outputs (the reference): greedy, and sampled."""
    path = str(tmp_path_factory.mktemp(request.param))
    save_tiny_checkpoint(request.param, path)
    llm = LLM(path, **ENGINE)
    return path, greedy(llm, make_prompts()), sampled(llm, make_prompts(3))


@pytest.mark.parametrize(
    ("checkpoint", "tp", "pp", "async_scheduling"),
    [
        ("llama3", 2, 1, False),
        ("llama3", 1, 2, False),
        ("llama3", 2, 2, True),
        # Biases, tied embeddings and q/k norms meet both splits at once: column and row shards,
        # the vocabulary split and the last stage's copy of the embedding, norms of split heads.
        ("llama-biased-tied", 2, 2, False),
        ("qwen3", 2, 2, True),
    ],
    ids=["llama3-tp2", "llama3-pp2", "llama3-tp2xpp2-async", "biased-tied-tp2xpp2", "qwen3-tp2xpp2-async"],
    indirect=["checkpoint"],
)
def test_split_matches_single_rank(start_llm, checkpoint, tp: int, pp: int, async_scheduling: bool) -> None:
    path, reference, sampled_reference = checkpoint
    llm = start_llm(
        path, tensor_parallel_size=tp, pipeline_parallel_size=pp, async_scheduling=async_scheduling, **ENGINE
    )
    assert greedy(llm, make_prompts()) == reference
    assert_same_samples(sampled(llm, make_prompts(3)), sampled_reference)
    llm.llm_engine.check_idle()


def test_sleep_wake_and_weight_updates_reach_every_rank(start_llm, tmp_path) -> None:
    """TP=2 with sleep mode: the same output after sleeping at level 1 and 2, and update_weights
    from a checkpoint equals an engine started on it."""
    from safetensors.torch import load_file, save_file

    first, second = tmp_path / "first", tmp_path / "second"
    save_tiny_checkpoint("llama3", str(first))
    save_tiny_checkpoint("llama3", str(second))
    weights = load_file(second / "model.safetensors")
    weights = {name: -tensor if "mlp" in name else tensor for name, tensor in weights.items()}
    save_file(weights, second / "model.safetensors", metadata={"format": "pt"})
    prompts = make_prompts(3)
    expected_second = greedy(LLM(str(second), **ENGINE), prompts)
    llm = start_llm(str(first), tensor_parallel_size=2, enable_sleep_mode=True, **ENGINE)
    before = greedy(llm, prompts)
    for level in (1, 2):
        llm.sleep(level)
        assert llm.is_sleeping
        llm.wake_up()
        assert greedy(llm, prompts) == before
    llm.update_weights(str(second))
    assert expected_second != before
    assert greedy(llm, prompts) == expected_second


def test_pipeline_keeps_batches_of_different_requests_in_flight(start_llm, tmp_path) -> None:
    """PP=2 with a KV pool small enough to preempt and chunked prefill of long prompts: the
    scheduler never reschedules a request whose token is in flight, yet stays correct."""
    save_tiny_checkpoint("llama3", str(tmp_path))
    prompts = [[(7 * i + j) % 250 + 1 for j in range(30 + 9 * i)] for i in range(8)]
    small = {**ENGINE, "num_gpu_blocks": 24, "block_size": 8, "max_num_batched_tokens": 48}
    reference = greedy(LLM(str(tmp_path), **small), prompts, max_tokens=16)
    llm = start_llm(str(tmp_path), pipeline_parallel_size=2, **small)
    assert greedy(llm, prompts, max_tokens=16) == reference
    assert llm.llm_engine.engine_core.batch_queue_size == 2


def test_uneven_head_split_matches_single_rank(start_llm, tmp_path) -> None:
    """The default model's layout over three ranks: 9 query and 3 KV heads, split unevenly by
    any power of two (SmolLM2-135M's, on a tiny random model). (Pipeline splits, tied
    embeddings included, run on the other tiny checkpoints.)"""
    config = LlamaConfig(
        vocab_size=384,
        hidden_size=144,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    save_random_checkpoint(config, str(tmp_path))
    prompts = make_prompts(4)
    reference = greedy(LLM(str(tmp_path), **ENGINE), prompts, max_tokens=16)
    llm = start_llm(str(tmp_path), tensor_parallel_size=3, **ENGINE)
    assert greedy(llm, prompts, max_tokens=16) == reference


def test_killed_worker_fails_the_engine_quickly_and_leaves_no_process(start_llm, tmp_path) -> None:
    save_tiny_checkpoint("llama3", str(tmp_path))
    llm = start_llm(str(tmp_path), tensor_parallel_size=2, **ENGINE)
    executor = llm.llm_engine.engine_core.executor
    pids = [process.pid for process in executor.processes]
    generation = GenerationUntilFailure(lambda: greedy(llm, make_prompts(4) * 50, max_tokens=100))
    generation.wait_in_flight(llm)
    os.kill(pids[1], signal.SIGKILL)
    error = generation.wait(FAILURE_DEADLINE_S)
    assert isinstance(error, EngineDeadError), error
    assert "rank 1" in str(error.__cause__)
    llm.shutdown()
    assert not [pid for pid in pids if is_running(pid)], "a worker process outlived the engine"


def test_model_must_split_evenly(tmp_path) -> None:
    save_tiny_checkpoint("llama3", str(tmp_path))  # 4 heads, 2 KV heads, 2 layers
    with pytest.raises(ConfigError, match="tensor_parallel_size must divide the model's 4 attention heads, got 3"):
        create_engine_config(model=str(tmp_path), device="cpu", tensor_parallel_size=3)
    with pytest.raises(ConfigError, match="pipeline_parallel_size must be <= the model's 2 layers, got 3"):
        create_engine_config(model=str(tmp_path), device="cpu", pipeline_parallel_size=3)
    with pytest.raises(ConfigError, match="'uni' runs one rank"):
        create_engine_config(
            model=str(tmp_path), device="cpu", tensor_parallel_size=2, distributed_executor_backend="uni"
        )
    with pytest.raises(ConfigError, match="distributed_executor_backend must be one of uni, mp, ray"):
        create_engine_config(model=str(tmp_path), device="cpu", distributed_executor_backend="slurm")
    with pytest.raises(ConfigError, match="tensor_parallel_size must be >= 1, got 0"):
        create_engine_config(model=str(tmp_path), device="cpu", tensor_parallel_size=0)
    # Four KV heads' worth of ranks share the two KV heads: allowed.
    assert (
        create_engine_config(model=str(tmp_path), device="cpu", tensor_parallel_size=4).parallel_config.world_size == 4
    )


def test_pipeline_layer_ranges_cover_every_layer_once() -> None:
    for num_layers in (2, 7, 28, 30):
        for pp_size in range(1, min(num_layers, 5) + 1):
            ranges = [get_pp_layer_range(num_layers, rank, pp_size) for rank in range(pp_size)]
            assert ranges[0][0] == 0 and ranges[-1][1] == num_layers
            assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
            sizes = [end - start for start, end in ranges]
            assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1


def _dummy_model(config, tp_rank: int = 0, tp_size: int = 1, pp_rank: int = 0, pp_size: int = 1) -> torch.nn.Module:
    from pagoda.attention.backends import get_attention_backend

    init_parallel_state(tp_rank, tp_size, pp_rank, pp_size)
    model = get_model_class(config)(config, get_attention_backend("torch"))
    init_dummy_weights(model, seed=3)
    return model


def test_dummy_weights_are_slices_of_one_model(parallel_state) -> None:
    """Each rank's dummy weights are its slices of the single-rank model's: any split serves
    the same random model."""
    config = TINY_CONFIGS["llama-biased-tied"]
    whole = dict(_dummy_model(config).named_parameters())
    for rank in range(2):
        part = dict(_dummy_model(config, tp_rank=rank, tp_size=2).named_parameters())
        rows = whole["model.layers.0.mlp.down_proj.weight"].shape[1] // 2
        down = whole["model.layers.0.mlp.down_proj.weight"][:, rank * rows : (rank + 1) * rows]
        assert torch.equal(part["model.layers.0.mlp.down_proj.weight"], down)
        vocab_rows = part["model.embed_tokens.weight"].shape[0]
        embed = whole["model.embed_tokens.weight"][rank * vocab_rows : (rank + 1) * vocab_rows]
        assert torch.equal(part["model.embed_tokens.weight"][: len(embed)], embed)
    last_stage = dict(_dummy_model(config, pp_rank=1, pp_size=2).named_parameters())
    assert "model.embed_tokens.weight" not in last_stage and "model.layers.0.input_layernorm.weight" not in last_stage
    # Tied embeddings: the last stage's LM head holds the embedding the first stage has.
    assert torch.equal(last_stage["lm_head.weight"], whole["model.embed_tokens.weight"])
    assert torch.equal(
        last_stage["model.layers.1.self_attn.o_proj.bias"], whole["model.layers.1.self_attn.o_proj.bias"]
    )


def test_checkpoint_shapes_are_the_unsplit_ones(parallel_state) -> None:
    config = TINY_CONFIGS["llama3"]
    single = checkpoint_shapes(_dummy_model(config))
    split = checkpoint_shapes(_dummy_model(config, tp_rank=1, tp_size=2))
    assert single == split
    assert single["model.layers.0.self_attn.k_proj.weight"] == (2 * 16, 64)


def test_server_with_a_killed_rank_reports_it_and_exits_cleanly(tmp_path) -> None:
    """`pagoda serve -tp 2`: serves, then a worker killed while idle ends the server (exit 1)
    within 10 s, /health turning 503 on the way, with no process left behind."""
    pytest.importorskip("fastapi")
    from server_utils import RemoteServer, child_pids, wait_until

    save_tiny_checkpoint("llama3", str(tmp_path))
    prompt = make_prompts(1)[0]
    server = RemoteServer(
        "--model", str(tmp_path), "--device", "cpu", "--dtype", "float32", "--max-model-len", "128", "-tp", "2"
    )
    try:
        body = {"prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
        response = server.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == NEW_TOKENS
        core = server.core_pid()
        # The ranks are children of the core's rank launcher, forked with its command line.
        (launcher,) = [pid for pid in child_pids(core) if b"rank_launcher" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        workers = child_pids(launcher)
        assert len(workers) == 2
        os.kill(workers[1], signal.SIGKILL)
        killed_at = time.monotonic()
        assert server.process.wait(FAILURE_DEADLINE_S) == 1
        assert time.monotonic() - killed_at < FAILURE_DEADLINE_S
        processes = [core, launcher, *workers]
        assert wait_until(lambda: not any(is_running(pid) for pid in processes), FAILURE_DEADLINE_S)
    finally:
        if server.process.poll() is None:
            server.stop()
