"""Start-up compiles what the first requests run: a kernel first compiled inside a request's step
stalls it by a quarter to half a second on the H200 (the LM head's GEMV on the first token, a
verify tile's width near max_tokens)."""

from __future__ import annotations

import pytest

from pagoda import LLM, SamplingParams

triton = pytest.importorskip("triton")


def count_compiles(monkeypatch) -> list[str]:
    """Names of the Triton kernels compiled from now on (a hook Triton calls after each compile)."""
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if runtime is None or not hasattr(runtime, "jit_post_compile_hook"):
        pytest.skip("this Triton has no jit_post_compile_hook")
    compiled: list[str] = []

    def hook(*args, **kwargs) -> None:
        fn = kwargs.get("fn")
        compiled.append(getattr(fn, "name", repr(fn)))

    monkeypatch.setattr(runtime, "jit_post_compile_hook", hook)
    return compiled


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 3])
def test_first_decode_requests_compile_no_kernel(monkeypatch, batch: int) -> None:
    with LLM("qwen3-0.6b", load_format="dummy", max_model_len=1024, num_gpu_blocks=256) as llm:
        compiled = count_compiles(monkeypatch)
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        llm.generate([[7] * 16] * batch, params, use_tqdm=False)
        assert compiled == []


@pytest.mark.gpu
def test_batch_invariant_requests_compile_no_gemm(monkeypatch) -> None:
    """Batch-invariant mode picks the GEMM's launch by the row count: prefills of many lengths and
    a wide decode batch run only GEMM kernels start-up compiled."""
    with LLM("qwen3-0.6b", load_format="dummy", batch_invariant=True, max_model_len=1024, num_gpu_blocks=512) as llm:
        compiled = count_compiles(monkeypatch)
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        prompts = [[7] * length for length in (17, 40, 100, 300, 700)] + [[9] * 16] * 100
        llm.generate(prompts, params, use_tqdm=False)
        assert [name for name in compiled if "gemv" in name or "sum_splits" in name] == []


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_warm_up_runs_each_eager_linear_shape_once_at_its_launch_points(tmp_path, batch_invariant: bool) -> None:
    """The head's GEMV at 1..GEMV_MAX_TOKENS rows; in batch-invariant mode every linear shape,
    once, at the first row count of each launch the invariant GEMM takes."""
    from model_utils import save_tiny_checkpoint

    from pagoda.model.layers.embedding import ParallelLMHead
    from pagoda.model.layers.linear import LinearBase
    from pagoda.model.ops import GEMV_MAX_TOKENS
    from pagoda.model.ops.triton_gemv import launch_change_points

    save_tiny_checkpoint("qwen3", str(tmp_path))
    engine = {"device": "cpu", "dtype": "float32", "max_model_len": 128, "num_gpu_blocks": 32}
    engine |= {"attention_backend": "triton", "batch_invariant": True} if batch_invariant else {}
    with LLM(str(tmp_path), max_num_seqs=4, max_num_batched_tokens=64, **engine) as llm:
        runner = llm.llm_engine.engine_core.executor.worker.model_runner
        launches = runner._eager_linear_launches()
    heads = [(module, rows) for module, rows in launches if isinstance(module, ParallelLMHead)]
    linears = [(module, rows) for module, rows in launches if isinstance(module, LinearBase)]
    assert len(heads) == 1
    head, head_rows = heads[0]
    if not batch_invariant:
        assert head_rows == list(range(1, GEMV_MAX_TOKENS + 1))
        assert linears == []
        return
    assert head_rows == launch_change_points(*head.weight.shape, runner.dtype, runner.device, 4)
    shapes = {
        (tuple(module.weight.shape), module.bias is not None)
        for module in runner.model.modules()
        if isinstance(module, LinearBase)
    }
    assert len(linears) == len(shapes) > 1
    for module, rows in linears:
        assert rows == launch_change_points(*module.weight.shape, runner.dtype, runner.device, 64)
