"""Verify graphs: with speculation (k drafts), steps whose requests bring at most q = 1 + k
tokens each replay a graph captured per padded request count (R rows, R * q tokens), so their
attention runs decode tiles with split-K; other steps keep their decode or mixed graphs."""

from __future__ import annotations

import pytest
import torch
from model_utils import save_tiny_checkpoint

from pagoda import LLM, SamplingParams
from pagoda.scheduler.output import CachedRequestData, SchedulerOutput
from pagoda.worker.cuda_graph import BatchDescriptor, CudaGraphManager, CUDAGraphMode

SIZES = [1, 2, 4, 8, 16, 32, 64]
K = 4
Q = K + 1


def test_verify_graphs_per_padded_request_count_within_the_token_limit() -> None:
    manager = CudaGraphManager(SIZES, max_decode_size=16, max_mixed_size=64, verify_query_len=Q)
    assert manager.verify_sizes == [1, 2, 4, 8]  # 16 rows x 5 tokens passes the 64-token limit
    verify = [key for key in manager.descriptors if key.decode_query_len == Q]
    assert verify == [BatchDescriptor(rows * Q, True, decode_query_len=Q) for rows in (8, 4, 2, 1)]
    assert [key.num_rows for key in verify] == [8, 4, 2, 1]
    assert BatchDescriptor(40, False).num_rows is None
    assert manager.verify_descriptor_for(3) == BatchDescriptor(20, True, decode_query_len=Q)
    assert manager.verify_descriptor_for(9) is None
    keys = manager.descriptors
    assert len(set(keys)) == len(keys) == 11 + 4
    assert [k.num_tokens for k in keys] == sorted((k.num_tokens for k in keys), reverse=True)


def test_no_verify_graphs_without_speculation() -> None:
    manager = CudaGraphManager(SIZES, max_decode_size=16, max_mixed_size=64)
    assert manager.verify_sizes == [] and manager.verify_descriptor_for(1) is None
    assert all(key.decode_query_len == 1 for key in manager.descriptors)
    with pytest.raises(ValueError, match="verify_query_len"):
        CudaGraphManager(SIZES, 16, 64, verify_query_len=0)


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("llama3"))
    save_tiny_checkpoint("llama3", path)
    llm = LLM(
        model=path,
        device="cpu",
        dtype="float32",
        max_model_len=64,
        block_size=4,
        num_gpu_blocks=64,
        max_num_seqs=16,
        speculative_config={"method": "ngram", "num_speculative_tokens": K},
    )
    yield llm.llm_engine.engine_core.executor.worker.model_runner
    llm.shutdown()


def step(*query_lens: int) -> SchedulerOutput:
    tokens = {f"r{i}": n for i, n in enumerate(query_lens)}
    return SchedulerOutput([], CachedRequestData(), tokens, sum(query_lens))


@pytest.mark.parametrize(
    ("query_lens", "expected", "num_rows"),
    [
        ((Q, Q, Q), BatchDescriptor(4 * Q, True, decode_query_len=Q), 4),
        ((Q, Q, 3, Q, Q), BatchDescriptor(8 * Q, True, decode_query_len=Q), 8),  # fewer drafts, padded rows
        ((Q,) + (1,) * 8, BatchDescriptor(16, False), 16),  # 13 tokens would pad to 80: mixed pads less
        ((3,), BatchDescriptor(Q, True, decode_query_len=Q), 1),
        ((2,), BatchDescriptor(2, False), 2),  # 2 tokens would pad to 5
        ((1, 1, 1), BatchDescriptor(4, True), 4),  # no drafts at all: a decode graph
        ((Q + 1, 1), BatchDescriptor(8, False), 8),  # a longer query: mixed
        ((Q,) * 9, BatchDescriptor(64, False), 16),  # more requests than any verify graph: mixed
    ],
)
def test_steps_replay_the_graph_of_their_kind(runner, query_lens, expected, num_rows) -> None:
    assert runner.decode_query_len == Q
    default = runner.cudagraph_manager
    runner.cudagraph_manager = CudaGraphManager(SIZES, runner.max_num_reqs, 64, verify_query_len=Q)
    try:
        execution = runner._determine_batch_execution_and_padding(step(*query_lens))
    finally:
        runner.cudagraph_manager = default
    assert execution.cudagraph_mode == CUDAGraphMode.FULL
    assert execution.batch_descriptor == expected
    assert (execution.num_input_tokens, execution.num_rows) == (expected.num_tokens, num_rows)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_verify_graphs_replay_and_keep_outputs(tmp_path) -> None:
    """Greedy n-gram speculation on CUDA graphs gives the eager engine's tokens, and its verify
    steps replay verify graphs (padded rows and tokens included)."""
    save_tiny_checkpoint("llama3", str(tmp_path))
    engine = {"device": "cuda", "attention_backend": "triton", "dtype": "float32", "max_model_len": 128}
    engine |= {"num_gpu_blocks": 256, "speculative_config": {"method": "ngram", "num_speculative_tokens": K}}
    engine["speculative_config"] |= {"prompt_lookup_min": 1, "prompt_lookup_max": 3}
    prompts = [[(7 * i + j) % 50 + 1 for j in range(5 + 3 * i)] * 2 for i in range(5)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

    eager = LLM(model=str(tmp_path), enforce_eager=True, **engine)
    expected = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    eager.shutdown()

    llm = LLM(model=str(tmp_path), **engine)
    manager = llm.llm_engine.engine_core.executor.worker.model_runner.cudagraph_manager
    assert manager is not None and manager.verify_sizes
    replayed = []
    replay = manager.replay

    def spy(key: BatchDescriptor) -> torch.Tensor:
        replayed.append(key)
        return replay(key)

    manager.replay = spy
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    llm.llm_engine.check_idle()
    llm.shutdown()
    assert got == expected
    assert any(key.decode_query_len == Q for key in replayed), replayed
