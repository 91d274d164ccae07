"""A byte-level tokenizer for the tiny random checkpoints (vocabulary 256, `model_utils.VOCAB`):
they ship no tokenizer, and a grammar needs one. Id 0 is the end of text; ids 1-255 are the
bytes 1-255, so any text but NUL has exactly one tokenization. `markers` (e.g. "<think>",
"</think>") take ids 1, 2, ... in place of those control bytes, as tokens of their own, the way
a reasoning model has them; `chat_template` makes it a chat model's."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

EOS = "<|endoftext|>"


def byte_tokenizer(markers: tuple[str, ...] = (), chat_template: str | None = None) -> PreTrainedTokenizerFast:
    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    # ByteLevel's alphabet, ordered by the byte each character stands for.
    ordered = sorted(byte_chars, key=_byte_of)
    names = [EOS, *markers, *ordered[1 + len(markers) :]]
    backend = Tokenizer(models.BPE(vocab={name: index for index, name in enumerate(names)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=EOS)
    tokenizer.add_tokens(list(markers))  # matched whole, at their ids above
    tokenizer.chat_template = chat_template
    return tokenizer


def save_byte_tokenizer(path: str, markers: tuple[str, ...] = (), chat_template: str | None = None) -> None:
    """Write the tokenizer's files into a checkpoint directory."""
    byte_tokenizer(markers, chat_template).save_pretrained(path)


def _byte_of(char: str) -> int:
    """The byte a ByteLevel alphabet character stands for (GPT-2's bytes_to_unicode)."""
    code = ord(char)
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    if code in printable:
        return code
    others = [b for b in range(256) if b not in printable]
    return others[code - 256]
