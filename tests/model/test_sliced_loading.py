"""Tensor-parallel loading from safetensors: each rank reads only its own slice of each weight.

A tiny Llama checkpoint (biases everywhere, an odd vocabulary so the last rank has a padding row,
untied LM head, several files) is loaded through `get_model` at TP size 2 as each rank in turn.
Every tensor read from the files is counted at safetensors' own API (`get_slice`/`get_tensor`),
so reading a whole tensor and narrowing it afterwards would show as too many bytes.
"""

from __future__ import annotations

import glob
import os
from collections import Counter
from collections.abc import Callable

import pytest
import torch
from model_utils import hf_named_weights
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig

from pagoda.attention.backends import get_attention_backend
from pagoda.model.loader import load_hf_config, safetensors_loader
from pagoda.model.loader.safetensors_loader import SafetensorsSlice, iter_safetensors_weights
from pagoda.model.registry import get_model_class

TP = 2
VOCAB, HIDDEN, INTERMEDIATE, HEADS, HEAD_SIZE = 75, 32, 48, 4, 8
VOCAB_PER_RANK = 38  # ceil(75 / 2): rank 1 holds 37 vocabulary rows and one zero padding row


def _save_checkpoint(path: str, num_kv_heads: int) -> dict[str, torch.Tensor]:
    """A tiny Llama saved in several files; returns its tensors by HF name."""
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=2,
        num_attention_heads=HEADS,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        attention_bias=True,
        mlp_bias=True,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_()  # norms and biases too, so that a wrong or missing slice shows
    model.save_pretrained(path, max_shard_size="20KB")
    files = glob.glob(os.path.join(path, "*.safetensors"))
    assert len(files) > 1
    return {name: tensor for file in files for name, tensor in load_file(file).items()}


@pytest.fixture(params=[1, 2], ids=["kv_heads=1", "kv_heads=2"])
def checkpoint(request, tmp_path) -> tuple[str, dict[str, torch.Tensor]]:
    """(directory, tensors by HF name); with one KV head, both ranks replicate it."""
    return str(tmp_path), _save_checkpoint(str(tmp_path), request.param)


class _CountingSlice:
    """A PySafeSlice that counts the bytes of what is read through it."""

    def __init__(self, inner, count: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self._inner, self._count = inner, count

    def get_shape(self) -> list[int]:
        return self._inner.get_shape()

    def __getitem__(self, index) -> torch.Tensor:
        return self._count(self._inner[index])


class _CountingFile:
    """safe_open's handle, adding up the bytes read of each tensor (by name) into `reads`."""

    def __init__(self, inner, reads: Counter[str]) -> None:
        self._inner, self._reads = inner, reads

    def __enter__(self) -> _CountingFile:
        self._inner.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._inner.__exit__(*exc)

    def keys(self) -> list[str]:
        return self._inner.keys()

    def get_tensor(self, name: str) -> torch.Tensor:
        return self._counter(name)(self._inner.get_tensor(name))

    def get_slice(self, name: str) -> _CountingSlice:
        return _CountingSlice(self._inner.get_slice(name), self._counter(name))

    def _counter(self, name: str) -> Callable[[torch.Tensor], torch.Tensor]:
        def count(tensor: torch.Tensor) -> torch.Tensor:
            self._reads[name] += tensor.numel() * tensor.element_size()
            return tensor

        return count


@pytest.fixture
def bytes_read(monkeypatch) -> Counter[str]:
    """Bytes read from the checkpoint files so far, by tensor name."""
    reads: Counter[str] = Counter()

    def counting_safe_open(path: str, framework: str, device: str) -> _CountingFile:
        return _CountingFile(safe_open(path, framework=framework, device=device), reads)

    monkeypatch.setattr(safetensors_loader, "safe_open", counting_safe_open)
    return reads


def _rank_share(name: str, tensor: torch.Tensor, rank: int, num_kv_heads: int) -> torch.Tensor:
    """The part of checkpoint tensor `name` that rank `rank` of TP holds: what it should read."""

    def part(index: int, count: int, dim: int = 0) -> torch.Tensor:
        size = tensor.shape[dim] // count
        return tensor.narrow(dim, index * size, size)

    if "embed_tokens" in name or "lm_head" in name:
        return tensor[rank * VOCAB_PER_RANK : (rank + 1) * VOCAB_PER_RANK]
    if any(proj in name for proj in ("q_proj", "gate_proj", "up_proj")):
        return part(rank, TP)
    if "k_proj" in name or "v_proj" in name:
        kv_parts = min(TP, num_kv_heads)  # fewer KV heads than ranks: each rank holds a whole one
        return part(rank * kv_parts // TP, kv_parts)
    if ("o_proj" in name or "down_proj" in name) and name.endswith(".weight"):
        return part(rank, TP, dim=1)
    return tensor  # norms and row-parallel biases: every rank holds them whole


def _expected_parameters(shares: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our parameters assembled from the rank's shares: q/k/v and gate/up stacked, vocab padded."""
    expected = dict(shares)
    for stacked, parts in (("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("gate_up_proj", ("gate_proj", "up_proj"))):
        for name in [name for name in expected if f".{parts[0]}." in name]:
            names = [name.replace(f".{parts[0]}.", f".{part}.") for part in parts]
            expected[name.replace(f".{parts[0]}.", f".{stacked}.")] = torch.cat([expected.pop(n) for n in names])
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        rows = expected[name]
        expected[name] = torch.cat([rows, rows.new_zeros(VOCAB_PER_RANK - len(rows), HIDDEN)])
    return expected


def test_each_rank_holds_and_reads_only_its_slices(load_model, checkpoint, parallel_state, bytes_read):
    path, full = checkpoint
    num_kv_heads = full["model.layers.0.self_attn.k_proj.weight"].shape[0] // HEAD_SIZE
    for rank in range(TP):
        parallel_state(tp_rank=rank, tp_size=TP)  # weights only: no collective runs
        bytes_read.clear()
        model = load_model(path, "safetensors")
        shares = {name: _rank_share(name, tensor, rank, num_kv_heads) for name, tensor in full.items()}

        params = dict(model.named_parameters())
        expected = _expected_parameters(shares)
        assert params.keys() == expected.keys()
        for name, tensor in expected.items():
            assert torch.equal(params[name], tensor), name

        assert bytes_read == {name: share.numel() * share.element_size() for name, share in shares.items()}
        # spelled out for the weights that are split: half of each, not the whole
        q = full["model.layers.0.self_attn.q_proj.weight"]
        assert bytes_read["model.layers.0.self_attn.q_proj.weight"] == q.numel() * 4 // TP
        down = full["model.layers.1.mlp.down_proj.weight"]
        assert bytes_read["model.layers.1.mlp.down_proj.weight"] == down.numel() * 4 // TP
        vocab_rows = VOCAB_PER_RANK if rank == 0 else VOCAB - VOCAB_PER_RANK
        assert bytes_read["lm_head.weight"] == vocab_rows * HIDDEN * 4
        k = full["model.layers.0.self_attn.k_proj.weight"]
        assert bytes_read["model.layers.0.self_attn.k_proj.weight"] == k.numel() * 4 // min(TP, num_kv_heads)


def test_tp1_reads_every_tensor_once_and_loads_as_from_full_tensors(load_model, checkpoint, bytes_read):
    path, full = checkpoint
    model = load_model(path, "safetensors")
    assert bytes_read == {name: tensor.numel() * tensor.element_size() for name, tensor in full.items()}
    ours = hf_named_weights(model)
    assert ours.keys() == full.keys()
    for name, tensor in full.items():
        assert torch.equal(ours[name], tensor), name

    # the same checkpoint as real in-memory tensors (as GGUF and update_weights pass them)
    hf_config = load_hf_config(path, "safetensors")
    from_tensors = get_model_class(hf_config)(hf_config, get_attention_backend("torch"))
    assert from_tensors.load_weights(full.items()) == full.keys()
    for (name, param), (_, reference) in zip(model.named_parameters(), from_tensors.named_parameters(), strict=True):
        assert torch.equal(param, reference), name


def test_shape_errors_are_unchanged_for_lazy_tensors(load_model, checkpoint, parallel_state):
    path, full = checkpoint
    full["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(HEADS * HEAD_SIZE - 2, HIDDEN)
    for file in glob.glob(os.path.join(path, "*.safetensors")):
        os.remove(file)
    save_file(full, os.path.join(path, "model.safetensors"))
    parallel_state(tp_rank=1, tp_size=TP)
    with pytest.raises(
        ValueError, match=r"'model\.layers\.0\.self_attn\.q_proj\.weight': checkpoint tensor has 30 rows"
    ):
        load_model(path, "safetensors")


def test_slice_narrows_and_materializes_exactly_and_rejects_out_of_range(tmp_path):
    tensor = torch.arange(24, dtype=torch.bfloat16).reshape(4, 6)
    save_file({"w": tensor}, str(tmp_path / "model.safetensors"))
    weights = iter_safetensors_weights(str(tmp_path))
    name, lazy = next(weights)  # the file stays open until the iterator moves past it
    assert name == "w" and isinstance(lazy, SafetensorsSlice)
    assert lazy.shape == torch.Size([4, 6]) and lazy.ndim == 2
    assert torch.equal(lazy.narrow(0, 1, 2), tensor[1:3])
    assert torch.equal(lazy.narrow(1, 4, 2), tensor[:, 4:])
    materialized = lazy.materialize()
    assert materialized.dtype == torch.bfloat16 and torch.equal(materialized, tensor)
    # safetensors itself would clamp these to fewer rows without a word
    with pytest.raises(IndexError, match=r"narrow \[3, 5\) of dim 0 must lie in \[0, 4\]"):
        lazy.narrow(0, 3, 2)
    with pytest.raises(IndexError, match=r"dim must be in \[0, 2\), got 2"):
        lazy.narrow(2, 0, 1)
    weights.close()
