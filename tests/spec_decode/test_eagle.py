"""`method="eagle"` and `"eagle3"` end to end, with tiny random heads saved in the published
layouts (see `spec_decode_utils.save_eagle_head`): outputs identical with speculation on and off
(on the CPU in float32, exactly), under chunked prefill, a pool small enough to preempt, and
aborts; bad heads refused naming the field.

A random head's drafts rarely hold, so acceptance itself is shown on an EAGLE-1 head that can
predict its target: a one-layer target whose attention output is zero (o_proj = 0: the next
token is a function of the current one), with unit norms and unit-RMS embeddings, and a head
with the target's layer and `fc` = [I | 0] (it reads only the embedding of the token after
each position). Its greedy drafts hold wherever the shifted ids, the first draft's position
and the one-token steps are right. EAGLE-3's capture of the target's hidden states is checked
against HF's hidden states of the same layers.
"""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch
from engine_utils import TARGETS, target_settings
from model_utils import TINY_CONFIGS, save_random_checkpoint
from safetensors.torch import load_file, save_file
from spec_decode_utils import NEW_TOKENS, prompts, reference, run, save_eagle_head
from transformers import AutoModelForCausalLM

from pagoda import LLM, SamplingParams
from pagoda.config import ConfigError
from pagoda.engine.arg_utils import create_engine_config


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    """A 4-layer tiny Llama target, an EAGLE-1 and an EAGLE-3 head for it."""
    config = copy.deepcopy(TINY_CONFIGS["llama3"])
    config.num_hidden_layers = 4
    paths = {name: str(tmp_path_factory.mktemp(name)) for name in ("target", "eagle", "eagle3")}
    save_random_checkpoint(config, paths["target"])
    save_eagle_head(paths["eagle"], config, "eagle")
    save_eagle_head(paths["eagle3"], config, "eagle3")
    return paths


def eagle(checkpoints: dict[str, str], method: str, k: int) -> dict:
    return {"method": method, "model": checkpoints[method], "num_speculative_tokens": k}


@pytest.fixture(params=TARGETS)
def target(request) -> dict:
    return {**target_settings(request.param), "max_model_len": 128, "num_gpu_blocks": 256}


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
@pytest.mark.parametrize("k", [1, 3])
def test_outputs_are_identical_with_an_eagle_head(checkpoints, target, method: str, k: int) -> None:
    expected, expected_values = reference(checkpoints["target"], target)
    results, values, llm = run(checkpoints["target"], target, eagle(checkpoints, method, k))
    assert results == expected
    torch.testing.assert_close(torch.from_numpy(values), torch.from_numpy(expected_values), rtol=1e-5, atol=1e-5)
    stats = llm.llm_engine.engine_core.scheduler.make_stats().spec_decoding
    assert stats.num_verify_steps > 0 and len(stats.drafted_per_position) == k


ASYNC_CPU = {"device": "cpu", "async_scheduling": True, "dtype": "float32", "max_model_len": 128}
VARIANTS = {
    "chunked-prefill-16-no-prefix-caching": {
        "max_num_batched_tokens": 16,
        "max_num_seqs": 8,
        "enable_prefix_caching": False,
        "num_gpu_blocks": 256,
    },
    "tiny-kv-pool-preempts": {"num_gpu_blocks": 30, "block_size": 4},
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_eagle3_outputs_are_identical_under_chunking_and_preemption(checkpoints, variant: str) -> None:
    engine = {**ASYNC_CPU, **VARIANTS[variant]}
    expected, _ = reference(checkpoints["target"], engine, prompt_seed=1)
    results, _, llm = run(checkpoints["target"], engine, eagle(checkpoints, "eagle3", 3), prompt_seed=1)
    assert results == expected
    if variant == "tiny-kv-pool-preempts":
        assert llm.llm_engine.engine_core.scheduler.make_stats().num_preemptions > 0


@pytest.fixture(scope="module")
def predictable(tmp_path_factory) -> dict[str, str]:
    """A one-layer target whose next token depends on the current one only, and an EAGLE-1
    head that computes the same function of the token after each position (module docstring)."""
    config = copy.deepcopy(TINY_CONFIGS["llama3"])
    config.num_hidden_layers = 1
    config.rms_norm_eps = 1e-12
    paths = {name: str(tmp_path_factory.mktemp(name)) for name in ("bigram", "bigram-eagle")}
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.3)
        model.model.layers[0].self_attn.o_proj.weight.zero_()
        embed = model.model.embed_tokens.weight
        embed.div_(embed.pow(2).mean(dim=1, keepdim=True).sqrt())
    model.save_pretrained(paths["bigram"])
    save_eagle_head(paths["bigram-eagle"], config, "eagle")
    weights = load_file(os.path.join(paths["bigram"], "model.safetensors"))
    head = {
        name.removeprefix("model."): tensor
        for name, tensor in weights.items()
        if name.startswith("model.layers.0.") and "input_layernorm" not in name
    }
    hidden = config.hidden_size
    head["fc.weight"] = torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1)
    save_file(head, os.path.join(paths["bigram-eagle"], "model.safetensors"))
    return paths


@pytest.mark.parametrize("variant", ["plain", "chunked-prefill-8", "async-preempts"])
def test_an_eagle_head_that_predicts_its_target_gets_its_drafts_accepted(predictable, variant: str) -> None:
    engine = {"device": "cpu", "dtype": "float32", "max_model_len": 128, "num_gpu_blocks": 256}
    engine.update(
        {
            "plain": {},
            "chunked-prefill-8": {"max_num_batched_tokens": 8, "max_num_seqs": 4},
            "async-preempts": {"async_scheduling": True, "num_gpu_blocks": 24, "block_size": 4},
        }[variant]
    )
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    batch = prompts(6, count=4)
    plain = LLM(model=predictable["bigram"], **engine)
    expected = [o.outputs[0].token_ids for o in plain.generate(batch, params, use_tqdm=False)]
    plain.shutdown()
    spec = {"method": "eagle", "model": predictable["bigram-eagle"], "num_speculative_tokens": 3}
    llm = LLM(model=predictable["bigram"], **engine, speculative_config=spec)
    assert [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)] == expected
    stats = llm.llm_engine.engine_core.scheduler.make_stats().spec_decoding
    assert stats.num_draft_tokens > 0 and stats.acceptance_rate > 0.9, stats
    llm.llm_engine.check_idle()


def test_eagle3_reads_the_residual_stream_entering_its_layers(checkpoints) -> None:
    """The aux buffer's columns after a prefill equal HF's hidden_states of layers 2, 2 and 1
    (4 layers: the default (2, L // 2, L - 3))."""
    llm = LLM(
        model=checkpoints["target"], **ASYNC_CPU, num_gpu_blocks=256, speculative_config=eagle(checkpoints, "eagle3", 2)
    )
    prompt = prompts(7, count=1)[0]
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    aux = runner.drafter.aux_hidden_states[: len(prompt)]
    hf = AutoModelForCausalLM.from_pretrained(checkpoints["target"], dtype=torch.float32)
    with torch.no_grad():
        states = hf(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    hidden = hf.config.hidden_size
    for column, layer in enumerate((2, 2, 1)):
        torch.testing.assert_close(
            aux[:, column * hidden : (column + 1) * hidden], states[layer][0], rtol=1e-4, atol=1e-4
        )


def test_bad_heads_are_refused_naming_the_field(checkpoints, tmp_path) -> None:
    def refused(method: str, path: str, message: str) -> None:
        with pytest.raises(ConfigError, match=message):
            create_engine_config(
                model=checkpoints["target"],
                device="cpu",
                speculative_config={"method": method, "model": path, "num_speculative_tokens": 2},
            )

    refused("eagle", checkpoints["eagle3"], "speculative_config.method is 'eagle' but .* is an EAGLE-3 head")
    refused("eagle3", checkpoints["eagle"], "speculative_config.method is 'eagle3' but .* is an EAGLE-1 head")
    refused("eagle", str(tmp_path), "speculative_config.model must be a directory with an EAGLE head's config.json")
    wider = str(tmp_path / "wider")
    config = copy.deepcopy(TINY_CONFIGS["llama3"])
    config.hidden_size = 128
    save_eagle_head(wider, config, "eagle3")
    refused("eagle3", wider, "reads hidden states of size 128, the target's are 64")
    with open(os.path.join(checkpoints["eagle3"], "config.json")) as file:
        head_config = json.load(file)
    bad_layers = str(tmp_path / "bad-layers")
    save_eagle_head(bad_layers, TINY_CONFIGS["llama3"], "eagle3")
    with open(os.path.join(bad_layers, "config.json"), "w") as file:
        json.dump({**head_config, "eagle_aux_hidden_state_layer_ids": [0, 1, 9]}, file)
    refused("eagle3", bad_layers, r"eagle_aux_hidden_state_layer_ids must be 3 layer indices in \[0, 4\)")


def test_dummy_heads_resolve_for_a_dummy_target_only(checkpoints) -> None:
    """Benchmarks time EAGLE at Llama-3.1-8B's shape with random heads (nothing is loaded here)."""
    for method, name in (("eagle", "eagle-llama-3.1-8b"), ("eagle3", "eagle3-llama-3.1-8b")):
        spec = {"method": method, "model": name, "num_speculative_tokens": 4}
        config = create_engine_config(
            model="llama-3.1-8b", load_format="dummy", device="cpu", max_model_len=4096, speculative_config=spec
        )
        head = config.speculative_config.draft_model_config
        assert head.load_format == "dummy" and head.hf_config.num_hidden_layers == 1
        assert head.hf_config.hidden_size == 4096 and head.hf_config.max_position_embeddings >= 4096
    with pytest.raises(ConfigError, match=r"is a dummy head .* load_format='dummy'"):
        create_engine_config(
            model=checkpoints["target"],
            device="cpu",
            speculative_config={"method": "eagle3", "model": "eagle3-llama-3.1-8b", "num_speculative_tokens": 2},
        )
