"""Sleep mode and in-place weight updates, through `LLM`, on tiny random checkpoints (CPU).

The state machine: sleep at both levels, wake with each tag combination, requests refused
while any tag sleeps, sleeping refused while requests are in flight, the prefix cache reset
when the KV cache wakes, and `update_weights` from a checkpoint path or from tensors turning
the engine into the other checkpoint's model. Greedy output after wake-up must be identical
to before.
"""

from __future__ import annotations

import pytest
import torch
from model_utils import TINY_CONFIGS, randomize_, save_tiny_checkpoint
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from pagoda import LLM, SamplingParams
from pagoda.engine.errors import EngineSleepingError

ARCH = "qwen3"  # tied embeddings: the loader skips lm_head.weight, update_weights must too
NEW_TOKENS = 8
PROMPTS = [[5, 17, 42, 99, 3, 250, 7, 61, 8, 11, 13, 200, 31, 44, 90, 1, 2, 3], [9, 8, 7], [100, 101, 102, 103, 104]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def engine_kwargs(**overrides) -> dict:
    return {
        "device": "cpu",
        "attention_backend": "torch",
        "async_scheduling": False,
        "dtype": "float32",
        "max_model_len": 64,
        "num_gpu_blocks": 64,
        "block_size": 4,
        "enable_sleep_mode": True,
        **overrides,
    }


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("sleep-a"))
    save_tiny_checkpoint(ARCH, path)
    return path


@pytest.fixture(scope="module")
def second_checkpoint(tmp_path_factory) -> str:
    """The same architecture with other random weights."""
    path = str(tmp_path_factory.mktemp("sleep-b"))
    torch.manual_seed(4321)
    model = AutoModelForCausalLM.from_config(TINY_CONFIGS[ARCH], dtype=torch.float32)
    randomize_(model)
    model.save_pretrained(path)
    return path


def greedy(llm: LLM, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    return [list(output.outputs[0].token_ids) for output in llm.generate(prompts, GREEDY, use_tqdm=False)]


def memory_pool(llm: LLM):
    return llm.llm_engine.engine_core.executor.worker.memory_pool


def released(llm: LLM) -> dict[str, bool]:
    pool = memory_pool(llm)
    return {tag: pool.is_released(tag) for tag in ("weights", "kv_cache")}


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("level", [1, 2])
def test_sleep_and_wake_keep_greedy_output(checkpoint, level: int, async_scheduling: bool) -> None:
    llm = LLM(model=checkpoint, **engine_kwargs(async_scheduling=async_scheduling))
    before = greedy(llm)
    llm.sleep(level=level)
    assert llm.is_sleeping
    assert released(llm) == {"weights": True, "kv_cache": True}
    llm.wake_up()
    assert not llm.is_sleeping
    assert released(llm) == {"weights": False, "kv_cache": False}
    assert greedy(llm) == before
    llm.llm_engine.check_idle()


def test_level_2_drops_the_weights_and_wake_reloads_them(checkpoint) -> None:
    llm = LLM(model=checkpoint, **engine_kwargs())
    model = llm.llm_engine.engine_core.executor.worker.model_runner.model
    embedding = model.get_parameter("model.embed_tokens.weight")
    original = embedding.detach().clone()
    llm.sleep(level=2)
    memory_pool(llm).restore("weights")  # what the pool alone gives back: zeros, not the weights
    assert not embedding.detach().any()
    memory_pool(llm).release("weights", offload=False)
    llm.wake_up()
    assert torch.equal(embedding.detach(), original)


def test_wake_one_tag_at_a_time_and_refuse_requests_until_both_are_awake(checkpoint) -> None:
    llm = LLM(model=checkpoint, **engine_kwargs())
    before = greedy(llm)
    llm.sleep(level=1)
    with pytest.raises(EngineSleepingError, match=r"the engine is sleeping.*call wake_up"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm.wake_up(["weights"])
    assert released(llm) == {"weights": False, "kv_cache": True}
    assert llm.is_sleeping, "partly awake is still asleep"
    with pytest.raises(EngineSleepingError, match="kv_cache released"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    with pytest.raises(RuntimeError, match="'weights' is awake"):
        llm.wake_up(["weights"])
    llm.wake_up(["kv_cache"])
    assert not llm.is_sleeping
    assert greedy(llm) == before
    # The other order: the KV cache first.
    llm.sleep(level=1)
    llm.wake_up(["kv_cache"])
    assert released(llm) == {"weights": True, "kv_cache": False}
    llm.wake_up(["weights"])
    assert greedy(llm) == before
    llm.llm_engine.check_idle()


def test_misuse_gets_clear_errors(checkpoint) -> None:
    plain = LLM(model=checkpoint, **engine_kwargs(enable_sleep_mode=False))
    with pytest.raises(RuntimeError, match="enable_sleep_mode=True"):
        plain.sleep(1)
    assert not plain.is_sleeping

    llm = LLM(model=checkpoint, **engine_kwargs())
    with pytest.raises(ValueError, match="sleep level must be 1 or 2, got 3"):
        llm.sleep(level=3)
    with pytest.raises(RuntimeError, match="not asleep"):
        llm.wake_up()
    llm.sleep(level=1)
    with pytest.raises(RuntimeError, match="already asleep"):
        llm.sleep(level=1)
    with pytest.raises(ValueError, match="unknown sleep tag 'activations'"):
        llm.wake_up(["activations"])
    with pytest.raises(RuntimeError, match=r"wake_up\(\['weights'\]\) before update_weights"):
        llm.update_weights([])
    llm.wake_up()
    assert not llm.is_sleeping


def test_sleep_is_refused_with_requests_in_flight(checkpoint) -> None:
    llm = LLM(model=checkpoint, **engine_kwargs())
    engine = llm.llm_engine
    engine.add_request(PROMPTS[0], GREEDY)
    engine.step()
    with pytest.raises(RuntimeError, match=r"cannot sleep while the engine is busy.*1 unfinished"):
        llm.sleep(1)
    assert not llm.is_sleeping
    while engine.has_unfinished_requests():
        engine.step()
    llm.sleep(1)
    assert llm.is_sleeping


def test_waking_the_kv_cache_resets_the_prefix_cache(checkpoint) -> None:
    llm = LLM(model=checkpoint, **engine_kwargs())
    scheduler = llm.llm_engine.engine_core.scheduler
    prompt = [PROMPTS[0]]
    before = greedy(llm, prompt)
    hits = scheduler.make_stats().prefix_cache_hits
    assert greedy(llm, prompt) == before
    assert scheduler.make_stats().prefix_cache_hits > hits, "a repeated prompt must hit while awake"
    llm.sleep(1)
    llm.wake_up(["weights"])
    llm.wake_up(["kv_cache"])
    hits = scheduler.make_stats().prefix_cache_hits
    assert greedy(llm, prompt) == before
    assert scheduler.make_stats().prefix_cache_hits == hits, "blocks from before sleep were hit"


def test_update_weights_from_a_checkpoint_path(checkpoint, second_checkpoint) -> None:
    expected = greedy(LLM(model=second_checkpoint, **engine_kwargs()))
    llm = LLM(model=checkpoint, **engine_kwargs())
    original = greedy(llm)
    assert original != expected, "the two checkpoints must differ for the test to mean anything"
    llm.update_weights(second_checkpoint)
    # The repeated prompts would hit blocks computed with the old weights without the reset.
    assert greedy(llm) == expected
    llm.update_weights(checkpoint)
    assert greedy(llm) == original
    llm.llm_engine.check_idle()


def test_update_weights_from_tensors(checkpoint, second_checkpoint) -> None:
    expected = greedy(LLM(model=second_checkpoint, **engine_kwargs()))
    llm = LLM(model=checkpoint, **engine_kwargs())
    greedy(llm)
    new_weights = load_file(f"{second_checkpoint}/model.safetensors")
    loaded = llm.update_weights(iter(new_weights.items()))
    assert set(loaded) == set(new_weights) - {"lm_head.weight"}  # tied to the embedding
    assert greedy(llm) == expected


def test_update_weights_rejects_unknown_names_and_wrong_shapes(checkpoint) -> None:
    llm = LLM(model=checkpoint, **engine_kwargs())
    with pytest.raises(ValueError, match=r"'model.layers.0.self_attn.nonsense.weight' has no parameter"):
        llm.update_weights([("model.layers.0.self_attn.nonsense.weight", torch.zeros(2))])
    with pytest.raises(ValueError, match=r"'model.norm.weight'.*shape mismatch"):
        llm.update_weights([("model.norm.weight", torch.zeros(3))])


def test_update_weights_path_must_fill_every_weight(checkpoint, tmp_path) -> None:
    from safetensors.torch import save_file

    partial = {name: t for name, t in load_file(f"{checkpoint}/model.safetensors").items() if "layers.1." not in name}
    save_file(partial, str(tmp_path / "model.safetensors"))
    llm = LLM(model=checkpoint, **engine_kwargs())
    with pytest.raises(ValueError, match=r"weights missing from the checkpoint: model.layers.1"):
        llm.update_weights(str(tmp_path))


# ---- on the GPU (`pytest -m gpu tests/test_sleep_mode.py`): tagged CUDA virtual memory and
# CUDA graphs captured once, before any sleep, used after every wake-up and weight update.


def cuda_kwargs() -> dict:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    return engine_kwargs(device="cuda", attention_backend="triton", async_scheduling=True)


@pytest.mark.gpu
@pytest.mark.serial
@pytest.mark.parametrize("level", [1, 2])
def test_gpu_sleep_wake_and_update_weights_through_cuda_graphs(checkpoint, second_checkpoint, level: int) -> None:
    kwargs = cuda_kwargs()
    expected = greedy(LLM(model=second_checkpoint, **kwargs))
    llm = LLM(model=checkpoint, **kwargs)
    assert llm.llm_engine.engine_core.executor.worker.model_runner.cudagraph_manager is not None
    before = greedy(llm)
    llm.sleep(level)
    llm.wake_up(["weights"])
    llm.wake_up(["kv_cache"])
    assert greedy(llm) == before
    llm.update_weights(second_checkpoint)
    assert greedy(llm) == expected
    llm.llm_engine.check_idle()


@pytest.mark.gpu
@pytest.mark.serial
def test_gpu_sleep_hands_memory_back_at_a_real_shape() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from sleep_gpu import measure

    figures = measure("qwen3-0.6b", num_gpu_blocks=512)
    assert figures.freed_gib[1] > 1.0 and figures.freed_gib[2] > 1.0
