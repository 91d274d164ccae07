"""Mamba-2 and the Bamba hybrid (Mamba-2 + attention layers) end to end against HF transformers,
on tiny random checkpoints: greedy tokens equal HF's up to the first step whose top-2 margin is
under 1e-3 and the sampled tokens' logprobs within 1e-4 (float32), with chunked prefill that
continues a state across chunks shorter than the prompt, preemption (the hybrid's attention
blocks grow; a pure Mamba-2 request holds one block, so only the hybrid preempts), requests
joining a running batch, n = 2 (each sample its own state) and an abort; every test ends with
the pool whole (`check_idle`). On CUDA the same through the Triton kernels and CUDA graphs."""

from __future__ import annotations

import functools
import inspect
import os
import random

import pytest
import torch
from engine_utils import TARGETS, target_settings
from model_utils import check_sample_against_hf, randomize_
from transformers import AutoModelForCausalLM, BambaConfig, Mamba2Config
from transformers.models.mamba2 import modeling_mamba2

from pagoda import LLM, SamplingParams
from pagoda.config import ConfigError
from pagoda.kv_cache_interface import FullAttentionSpec, MambaSpec

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
MIN_MARGIN = 1e-3
LOGPROB_ATOL = 1e-4
NEW_TOKENS = 10
ENGINE = {"max_model_len": 128, "block_size": 16}
_MAMBA = dict(vocab_size=256, hidden_size=64, tie_word_embeddings=False)
# The gated RMSNorm normalizes each of the n_groups slices on its own (mamba_ssm, and
# transformers since its norm took a group_size); older transformers (5.17 on the GPU machine)
# normalize all groups at once, so there HF is a reference only for checkpoints of one group.
# (transformers 5.25 renamed the class Mamba2RMSNormGated.)
_GATED_NORM = getattr(modeling_mamba2, "Mamba2RMSNormGated", None) or modeling_mamba2.MambaRMSNormGated
N_GROUPS = 2 if "group_size" in inspect.signature(_GATED_NORM.__init__).parameters else 1
CONFIGS = {
    "mamba2": Mamba2Config(
        **_MAMBA, num_hidden_layers=2, num_heads=8, head_dim=16, state_size=16, n_groups=N_GROUPS, chunk_size=8
    ),
    # Layer 1 attends, layers 0 and 2 are Mamba-2: two state groups and a full-attention group.
    "bamba": BambaConfig(
        **_MAMBA,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        attn_layer_indices=[1],
        mamba_n_heads=8,
        mamba_d_head=16,
        mamba_n_groups=N_GROUPS,
        mamba_d_state=16,
        mamba_chunk_size=8,
    ),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def tiny_model(request, tmp_path_factory) -> tuple[str, torch.nn.Module]:
    """A seeded random checkpoint; A_log and dt_bias spread so that states decay at many rates."""
    path = str(tmp_path_factory.mktemp(request.param))
    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(CONFIGS[request.param], dtype=torch.float32).eval()
    randomize_(model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("A_log"):
                param.uniform_(-1.0, 0.5)
            elif name.endswith("dt_bias"):
                param.uniform_(-2.0, 0.0)
    model.save_pretrained(path)
    return path, model


def make_prompts(seed: int, count: int, lengths: tuple[int, int] = (20, 40)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 256) for _ in range(rng.randint(*lengths))] for _ in range(count)]


# The CPU runs the synchronous target only (the async queue is the same for every model; the
# sequential reference scan is slow); CUDA runs all of them.
MAMBA_TARGETS = [t for t in TARGETS if t.id != "cpu-torch-async"]


@pytest.fixture(params=MAMBA_TARGETS)
def target(request) -> dict:
    return target_settings(request.param)


@functools.lru_cache(maxsize=64)
def _hf_reference(model: torch.nn.Module, prompt: tuple[int, ...], steps: int) -> tuple[list[int], list[float]]:
    return hf_reference(model, list(prompt), steps)


@torch.inference_mode()
def hf_reference(model: torch.nn.Module, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
    """HF's greedy tokens and top-2 margins, each step a full forward (no cache: its chunked scan)."""
    ids, tokens, margins = list(prompt), [], []
    for _ in range(steps):
        x = torch.tensor([ids])
        top2 = model(input_ids=x, attention_mask=torch.ones_like(x)).logits[0, -1].float().topk(2)
        margins.append(float(top2.values[0] - top2.values[1]))
        tokens.append(int(top2.indices[0]))
        ids.append(tokens[-1])
    return tokens, margins


def check_sample(hf_model: torch.nn.Module, prompt: list[int], sample) -> int:
    reference = _hf_reference(hf_model, tuple(prompt), len(sample.token_ids))
    return check_sample_against_hf(hf_model, prompt, sample, reference, MIN_MARGIN, LOGPROB_ATOL)


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)


def check_against_hf(llm: LLM, hf_model: torch.nn.Module, prompts: list[list[int]]) -> None:
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    compared = sum(check_sample(hf_model, p, o.outputs[0]) for p, o in zip(prompts, outputs, strict=True))
    assert compared >= len(prompts) * NEW_TOKENS // 2, "too few confident steps: the test checks nothing"
    llm.llm_engine.check_idle()


def test_state_groups_and_prefix_caching_off(tiny_model) -> None:
    """One MambaSpec group per state layer group, one block per request, caching off for the model."""
    path, hf_model = tiny_model
    llm = LLM(model=path, device="cpu", dtype="float32", num_gpu_blocks=32, **ENGINE)
    kv = llm.llm_engine.engine_core.scheduler.kv_cache_manager
    specs = kv.kv_cache_config.group_specs
    assert any(isinstance(spec, MambaSpec) for spec in specs)
    assert not kv.enable_caching
    if hf_model.config.model_type == "bamba":
        attention = [spec for spec in specs if isinstance(spec, FullAttentionSpec)]
        mamba = next(spec for spec in specs if isinstance(spec, MambaSpec))
        assert attention and attention[0].page_size_bytes == mamba.page_size_bytes >= 2 * mamba.state_bytes


def test_models_match_hf(tiny_model, target) -> None:
    """Prompts in one step and in chunks of 8 tokens (a state continued across 3-5 chunks)."""
    path, hf_model = tiny_model
    prompts = make_prompts(0, 3)
    check_against_hf(LLM(model=path, num_gpu_blocks=64, **ENGINE, **target), hf_model, prompts)
    llm = LLM(model=path, num_gpu_blocks=64, max_num_batched_tokens=8, max_num_seqs=4, **ENGINE, **target)
    check_against_hf(llm, hf_model, prompts)


@pytest.mark.parametrize("mode", ["none", "align"])
def test_preemption_recomputes_the_state(tiny_model, target, mode: str) -> None:
    """A pool too small for every request at once: preempted requests free their state blocks and
    recompute the state when they resume (with checkpoints: from a cached one where it survived)."""
    path, hf_model = tiny_model
    if hf_model.config.model_type != "bamba":
        pytest.skip("a pure Mamba-2 request never grows past its one block: nothing preempts")
    # A request holds 2 state blocks and 1-2 attention blocks of 96 tokens (their page is the
    # state's), with checkpoints 2 more while it crosses a boundary: 7 usable blocks admit two,
    # whose second attention blocks do not both fit.
    llm = LLM(
        model=path,
        num_gpu_blocks=8,
        max_num_batched_tokens=32,
        max_num_seqs=4,
        mamba_cache_mode=mode,
        **ENGINE,
        **target,
    )
    check_against_hf(llm, hf_model, make_prompts(1, 3, lengths=(88, 110)))
    assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0, "the pool was meant to force preemption"


def test_joining_requests_n2_and_abort(tiny_model) -> None:
    """Requests added while others decode, one with n = 2 (both samples greedy, each its own state),
    and one aborted mid-decode: the rest match HF and the pool is whole after."""
    path, hf_model = tiny_model
    llm = LLM(model=path, device="cpu", dtype="float32", num_gpu_blocks=64, max_num_batched_tokens=16, **ENGINE)
    engine = llm.llm_engine
    prompts = make_prompts(2, 4)
    engine.add_request(prompts[0], GREEDY, "a")
    engine.add_request(prompts[1], GREEDY, "aborted")
    finished = {}
    for step in range(40):
        if step == 3:
            engine.add_request(prompts[2], SamplingParams(**{**_greedy_fields(), "n": 2}), "pair")
            # Nothing of the prompt is shared: both samples start at once, each computing its state.
            assert {"0_pair", "1_pair"} <= set(engine.engine_core.scheduler.requests)
        if step == 6:
            engine.add_request(prompts[3], GREEDY, "late")
            engine.abort_requests(["aborted"])
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
        if not engine.has_unfinished_requests() and step > 6:
            break
    assert sorted(finished) == ["a", "late", "pair"]
    check_sample(hf_model, prompts[0], finished["a"].outputs[0])
    check_sample(hf_model, prompts[3], finished["late"].outputs[0])
    assert len(finished["pair"].outputs) == 2
    for sample in finished["pair"].outputs:
        check_sample(hf_model, prompts[2], sample)
    engine.check_idle()


CHECKPOINTED = {"max_model_len": 256, "block_size": 16, "mamba_cache_mode": "align"}


def test_prefix_cache_hits_resume_from_checkpoints(tiny_model, target) -> None:
    """mamba_cache_mode "align": a state checkpoint at every block boundary (16 tokens for
    Mamba-2, the hybrid's attention block of 96 for Bamba); the same prompts again hit every
    whole block but the last token's, resume from the checkpoint there, and match HF. Prefill
    chunks of 32 tokens end at the boundaries they reach."""
    path, hf_model = tiny_model
    llm = LLM(model=path, num_gpu_blocks=128, max_num_batched_tokens=32, **CHECKPOINTED, **target)
    kv = llm.llm_engine.engine_core.scheduler.kv_cache_manager
    assert kv.enable_caching
    prompts = make_prompts(5, 2, lengths=(100, 120))
    check_against_hf(llm, hf_model, prompts)
    hits_before = kv.prefix_cache_hits
    check_against_hf(llm, hf_model, prompts)
    expected = sum((len(p) - 1) // kv.hit_alignment * kv.hit_alignment for p in prompts)
    assert expected > 0 and kv.prefix_cache_hits - hits_before == expected


def test_n2_samples_share_the_prompt_checkpoint(tiny_model) -> None:
    """With checkpoints, the second sample of n = 2 waits for the first and resumes from the
    prompt's last checkpoint (a prefix hit); both samples are HF's greedy continuation."""
    path, hf_model = tiny_model
    llm = LLM(model=path, device="cpu", dtype="float32", num_gpu_blocks=128, **CHECKPOINTED)
    kv = llm.llm_engine.engine_core.scheduler.kv_cache_manager
    prompt = make_prompts(6, 1, lengths=(100, 110))[0]
    (output,) = llm.generate([prompt], SamplingParams(**{**_greedy_fields(), "n": 2}), use_tqdm=False)
    for sample in output.outputs:
        check_sample(hf_model, prompt, sample)
    assert kv.prefix_cache_hits == (len(prompt) - 1) // kv.hit_alignment * kv.hit_alignment > 0
    llm.llm_engine.check_idle()


def test_speculative_decoding_is_refused(tiny_model) -> None:
    path, _ = tiny_model
    with pytest.raises(ConfigError, match="speculative_config is not supported for state-space models"):
        LLM(
            model=path,
            device="cpu",
            dtype="float32",
            speculative_config={"method": "ngram", "num_speculative_tokens": 2},
        )


def _greedy_fields() -> dict:
    return {"temperature": 0.0, "max_tokens": NEW_TOKENS, "ignore_eos": True, "logprobs": 0}


@pytest.mark.skipif(not INTERPRET, reason="the kernels run on the CPU only under TRITON_INTERPRET=1")
@pytest.mark.parametrize("mode", ["none", "align"])
def test_triton_kernels_end_to_end_match_hf(tiny_model, monkeypatch, mode: str) -> None:
    """The engine on the CPU with the mixers' Triton kernels interpreted: chunked prefill (rows
    with and without a state), decode batches, with checkpoints a prompt run twice (the second
    resumes from a cached checkpoint); the same tokens and logprobs as HF. Interpreted kernels
    are slow: the hybrid runs without checkpoints, Mamba-2 with them."""
    if (mode == "align") != (tiny_model[1].config.model_type == "mamba2"):
        pytest.skip("one mode per model (CI time)")
    from pagoda.model.layers.mamba import mixer

    monkeypatch.setattr(mixer, "use_kernels", lambda x: True)
    path, hf_model = tiny_model
    settings = {**CHECKPOINTED, "mamba_cache_mode": mode}
    llm = LLM(model=path, device="cpu", dtype="float32", num_gpu_blocks=64, max_num_batched_tokens=16, **settings)
    # With checkpoints one prompt twice: the second run resumes from the first's checkpoint.
    prompts = make_prompts(3, 2) if mode == "none" else make_prompts(3, 1, lengths=(97, 100)) * 2
    params = SamplingParams(**{**_greedy_fields(), "max_tokens": 6})
    for prompt in prompts:
        (output,) = llm.generate([prompt], params, use_tqdm=False)
        check_sample(hf_model, prompt, output.outputs[0])
    if mode == "align":
        assert llm.llm_engine.engine_core.scheduler.kv_cache_manager.prefix_cache_hits > 0
    llm.llm_engine.check_idle()


@pytest.mark.gpu
def test_cuda_graph_decode_matches_eager(tiny_model) -> None:
    """Decode replays captured graphs (padded rows past the batch touch no state) with the same
    tokens and logprobs as eager execution, in float32, for a batch of 5 (graph size 8)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    path, _ = tiny_model
    prompts = make_prompts(4, 5)
    results = {}
    for eager in (True, False):
        llm = LLM(model=path, device="cuda", dtype="float32", num_gpu_blocks=64, enforce_eager=eager, **ENGINE)
        runner = llm.llm_engine.engine_core.executor.worker.model_runner
        assert (runner.cudagraph_manager is None) == eager
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        results[eager] = [
            [
                (token, entry[token].logprob)
                for entry, token in zip(o.outputs[0].logprobs, o.outputs[0].token_ids, strict=True)
            ]
            for o in outputs
        ]
        llm.llm_engine.check_idle()
        llm.shutdown()
    for graph, eager in zip(results[False], results[True], strict=True):
        assert [t for t, _ in graph] == [t for t, _ in eager]
        torch.testing.assert_close(
            torch.tensor([p for _, p in graph]), torch.tensor([p for _, p in eager]), atol=1e-4, rtol=0
        )


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.serial  # a real model's layer shapes: more than a GPU worker's 8 GiB
def test_mamba2_2_7b_shape_serves_with_cuda_graphs() -> None:
    """The published Mamba2-2.7B shape with dummy weights in bf16: 64 layers, decode from CUDA
    graphs, prompts up to 2k tokens in chunks; every request gets its tokens and the pool is whole."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    rng = random.Random(5)
    prompts = [[rng.randrange(1, 50000) for _ in range(rng.randint(10, 2000))] for _ in range(16)]
    llm = LLM("mamba2-2.7b", load_format="dummy", max_model_len=4096, max_num_batched_tokens=1024)
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 32 for o in outputs)
    assert llm.llm_engine.engine_core.executor.worker.model_runner.cudagraph_manager is not None
    llm.llm_engine.check_idle()
