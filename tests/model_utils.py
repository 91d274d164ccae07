"""Shared test helpers: tiny random checkpoints, HF references, and attention metadata and KV
caches built by hand, without the model runner."""

from __future__ import annotations

import copy
import inspect

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, PretrainedConfig, Qwen2Config, Qwen3Config

from pagoda.attention.backends import AttentionBackend
from pagoda.attention.layer import Attention
from pagoda.attention.metadata import AttentionMetadata
from pagoda.forward_context import ForwardContext


def build_attn_metadata(
    query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]], block_size: int
) -> tuple[AttentionMetadata, torch.Tensor]:
    """Metadata and positions for one step: request i computes its last `query_lens[i]` of
    `seq_lens[i]` tokens, its KV living in the blocks `block_tables[i]` (in order)."""
    slots, positions = [], []
    for query_len, seq_len, blocks in zip(query_lens, seq_lens, block_tables, strict=True):
        if seq_len > len(blocks) * block_size:
            raise ValueError(f"seq_len {seq_len} does not fit in {len(blocks)} blocks of {block_size}")
        for pos in range(seq_len - query_len, seq_len):
            positions.append(pos)
            slots.append(blocks[pos // block_size] * block_size + pos % block_size)
    max_blocks = max(len(blocks) for blocks in block_tables)
    block_table = torch.zeros(len(block_tables), max_blocks, dtype=torch.int32)
    for i, blocks in enumerate(block_tables):
        block_table[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
    query_start_loc = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.cumsum(torch.tensor(query_lens), 0)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    metadata = AttentionMetadata(
        num_reqs=len(query_lens),
        num_actual_tokens=sum(query_lens),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        block_size=block_size,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens_t,
        block_table=block_table,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc_cpu=query_start_loc.clone(),
        seq_lens_cpu=seq_lens_t.clone(),
    )
    return metadata, torch.tensor(positions, dtype=torch.int64)


def allocate_kv_caches(
    model: torch.nn.Module, num_blocks: int, block_size: int, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """One zeroed [2, num_blocks, block_size, num_kv_heads, head_size] tensor per attention layer, by name."""
    return {
        module.layer_name: torch.zeros(
            AttentionBackend.get_kv_cache_shape(num_blocks, module.get_kv_cache_spec(block_size, dtype)), dtype=dtype
        )
        for module in model.modules()
        if isinstance(module, Attention)
    }


def forward_context(metadata: AttentionMetadata, kv_caches: dict[str, torch.Tensor]) -> ForwardContext:
    """Every layer reads the same metadata (one KV-cache group: no layer slides out of its blocks)."""
    return ForwardContext(attn_metadata=dict.fromkeys(kv_caches, metadata), kv_caches=kv_caches)


def run_step(
    model: torch.nn.Module,
    kv_caches: dict[str, torch.Tensor],
    token_ids: torch.Tensor,
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    intermediate: object = None,
) -> torch.Tensor | object:
    """One step of our model (see `build_attn_metadata`): logits on the last pipeline stage,
    the stage's intermediate tensors on an earlier one."""
    metadata, positions = build_attn_metadata(query_lens, seq_lens, block_tables, block_size)
    with torch.no_grad():
        out = model(token_ids, positions, forward_context(metadata, kv_caches), intermediate)
        return model.compute_logits(out) if model.model.is_last_stage else out


def hf_logits(hf_model: torch.nn.Module, token_ids: torch.Tensor) -> torch.Tensor:
    """HF's float32 logits over one sequence (an explicit attention mask: without one HF masks
    every id equal to pad_token_id)."""
    with torch.no_grad():
        return hf_model(token_ids[None], attention_mask=torch.ones_like(token_ids[None])).logits[0].float()


def hf_named_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Our model's parameters under HF checkpoint names: merged qkv / gate_up split back apart
    (tensor-parallel size 1)."""
    weights = {}
    for name, param in model.named_parameters():
        if ".qkv_proj." in name:
            qkv = model.get_submodule(name.rsplit(".", 1)[0])
            for part, tensor in zip(("q", "k", "v"), param.split([qkv.q_size, qkv.kv_size, qkv.kv_size]), strict=True):
                weights[name.replace(".qkv_proj.", f".{part}_proj.")] = tensor
        elif ".gate_up_proj." in name:
            gate, up = param.chunk(2)
            weights[name.replace(".gate_up_proj.", ".gate_proj.")] = gate
            weights[name.replace(".gate_up_proj.", ".up_proj.")] = up
        else:
            weights[name] = param
    return weights


VOCAB = 256
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
)


SLIDING_WINDOW = 8


def _tiny_configs() -> dict[str, PretrainedConfig]:
    return {
        "llama3": LlamaConfig(
            **_COMMON,
            rope_theta=10000.0,
            # low/high frequency wavelength bounds 32 and 8: with head_dim 16 all three bands occur
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        ),
        "llama-biased-tied": LlamaConfig(**_COMMON, attention_bias=True, mlp_bias=True, tie_word_embeddings=True),
        "mistral": MistralConfig(**_COMMON, sliding_window=None, rope_theta=1000.0),
        # Windows of 8 tokens (two blocks of 4): prompts of 30-40 tokens are 4-5 windows long.
        "mistral-sliding": MistralConfig(**_COMMON, sliding_window=SLIDING_WINDOW, rope_theta=1000.0),
        # Layer 0 full, layer 1 sliding (max_window_layers=1): two KV-cache groups.
        "qwen2-sliding": Qwen2Config(
            **_COMMON,
            use_sliding_window=True,
            sliding_window=SLIDING_WINDOW,
            max_window_layers=1,
            tie_word_embeddings=False,
        ),
        "qwen2": Qwen2Config(**_COMMON, tie_word_embeddings=False),
        "qwen3": Qwen3Config(**_COMMON, head_dim=32, tie_word_embeddings=True),
    }


@torch.no_grad()
def randomize_(model: torch.nn.Module) -> None:
    """Weights large enough that logits are far from flat; norms and biases away from 1 and 0, so
    that loading them wrong shows."""
    for name, param in model.named_parameters():
        if "norm" in name:
            param.uniform_(0.5, 1.5)
        elif param.ndim == 1:
            param.normal_(0.0, 0.2)
        else:
            param.normal_(0.0, 0.3)


TINY_CONFIGS = _tiny_configs()


def save_tiny_checkpoint(name: str, path: str, sharded: bool = False, vocab_size: int = VOCAB) -> torch.nn.Module:
    """Save a tiny random model of architecture `name` (a key of TINY_CONFIGS) with
    `save_pretrained` (`vocab_size` past VOCAB: padding past the byte tokenizer's ids); returns
    the HF model, in eval mode."""
    torch.manual_seed(1234)
    config = TINY_CONFIGS[name]
    if vocab_size != config.vocab_size:
        config = copy.deepcopy(config)
        config.vocab_size = vocab_size
    hf_model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_(hf_model)
    hf_model.eval()
    hf_model.save_pretrained(path, max_shard_size="100KB" if sharded else "1GB")
    return hf_model


@torch.inference_mode()
def hf_greedy(model: torch.nn.Module, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy continuation by an HF model with its own KV cache, never stopping at eos.

    Returns (tokens, top-2 logit margin at each step): where the margin is tiny, float
    rounding may legitimately pick the other token."""
    tokens: list[int] = []
    margins: list[float] = []
    past = None
    # transformers 5.25 renamed the argument and output `past_key_values` to `cache` (the old
    # name warns, to go in 5.40); the GPU machine's 5.17 knows only the old one.
    cache_name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    input_ids = torch.tensor([prompt_ids])
    for _ in range(max_new_tokens):
        out = model(input_ids=input_ids, use_cache=True, **{cache_name: past})
        past = getattr(out, cache_name)
        top2 = out.logits[0, -1].float().topk(2)
        margins.append(float(top2.values[0] - top2.values[1]))
        tokens.append(int(top2.indices[0]))
        input_ids = top2.indices[:1].view(1, 1)
    return tokens, margins


def assert_greedy_match(ours: list[int], reference: list[int], margins: list[float], min_margin: float) -> int:
    """Tokens must be identical up to the first step whose reference margin is below
    `min_margin`; returns how many steps were compared."""
    compared = next((i for i, m in enumerate(margins) if m < min_margin), len(margins))
    assert ours[:compared] == reference[:compared], (ours, reference, margins)
    return compared


@torch.inference_mode()
def hf_logprobs(model: torch.nn.Module, prompt: list[int], tokens: list[int]) -> list[float]:
    """HF's log-probability of each generated token, from one forward over prompt + tokens."""
    ids = torch.tensor([prompt + tokens])
    logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0].float()
    logprobs = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    return logprobs[torch.arange(len(tokens)), torch.tensor(tokens)].tolist()


def check_sample_against_hf(
    hf_model: torch.nn.Module,
    prompt: list[int],
    sample,
    reference: tuple[list[int], list[float]],
    min_margin: float,
    logprob_atol: float,
) -> int:
    """A greedy `sample` (with `logprobs=0`) against HF: its tokens equal `reference` (HF's tokens
    and top-2 margins) up to the first step of margin under `min_margin`, and its logprobs there
    are HF's within `logprob_atol`; returns how many steps were compared."""
    steps = assert_greedy_match(list(sample.token_ids), *reference, min_margin)
    ours = [entry[token].logprob for entry, token in zip(sample.logprobs, sample.token_ids, strict=True)]
    expected = hf_logprobs(hf_model, prompt, list(sample.token_ids[:steps]))
    torch.testing.assert_close(torch.tensor(ours[:steps]), torch.tensor(expected), atol=logprob_atol, rtol=0)
    return steps


def save_random_checkpoint(config: PretrainedConfig, path: str, seed: int = 1234) -> None:
    """Save a tiny HF model of `config`, its weights seeded and made as `randomize_` makes them,
    with `save_pretrained` (for configs built in a test rather than listed in TINY_CONFIGS)."""
    torch.manual_seed(seed)
    hf_model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_(hf_model)
    hf_model.save_pretrained(path)


def save_unit_gain_checkpoint(config: PretrainedConfig, path: str, seed: int = 0) -> None:
    """Save a tiny HF model of `config` with weights scaled like a trained model's: each matrix
    N(0, 1 / fan_in), so a layer neither grows nor shrinks its input (gain about 1); embeddings
    N(0, 1), norms in [0.5, 1.5]. Unlike `randomize_`, small perturbations (FP8 rounding) stay
    small through the layers, so quantized logits can be compared with a tolerance."""
    torch.manual_seed(seed)
    hf_model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            elif param.ndim >= 2 and "embed" not in name:
                param.normal_(0.0, param.shape[-1] ** -0.5)
            else:
                param.normal_(0.0, 1.0)
    hf_model.save_pretrained(path)
