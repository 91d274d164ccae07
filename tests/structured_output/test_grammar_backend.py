"""The backend: specs checked without a tokenizer (errors name the field), compiled and cached;
the grammars' vocabulary is the tokenizer's, whatever the model pads past it."""

from __future__ import annotations

import pytest
import torch
from structured_output.byte_tokenizer import byte_tokenizer
from structured_output.conftest import EOS_ID, VOCAB

from pagoda.errors import InvalidRequestError
from pagoda.sample.logits_processing import apply_token_bitmask
from pagoda.sample.metadata import TokenBitmask
from pagoda.sampling_params import StructuredOutputsParams
from pagoda.structured_output.backend import GrammarBackend, check, grammar_vocab_size
from pagoda.structured_output.spec import GrammarSpec
from pagoda.structured_output.state import GrammarBatch, GrammarState, allocate_bitmask

VALID = [
    StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}}),
    StructuredOutputsParams(json='{"type": "array", "items": {"type": "string"}}'),
    StructuredOutputsParams(json_object=True),
    StructuredOutputsParams(regex=r"[a-z]{2,5}\d"),
    StructuredOutputsParams(choice=["yes", "no", 'say "maybe"']),
    StructuredOutputsParams(grammar='root ::= "(" [a-z]+ ")"'),
]
INVALID = [
    (StructuredOutputsParams(json={"type": "objec"}), "structured_outputs.json", "objec"),
    (StructuredOutputsParams(json="{not json"), "structured_outputs.json", "JSON schema"),
    (StructuredOutputsParams(regex="(ab"), "structured_outputs.regex", "parenthesis"),
    (StructuredOutputsParams(grammar='root ::= "a" |'), "structured_outputs.grammar", "EBNF"),
    (StructuredOutputsParams(grammar='start ::= "a"'), "structured_outputs.grammar", "root"),
]


@pytest.mark.parametrize("params", VALID, ids=lambda p: p.kind)
def test_valid_specs_check_and_compile(backend, params: StructuredOutputsParams) -> None:
    spec = GrammarSpec.of(params)
    check(spec)
    assert backend.compile(spec) is not None


@pytest.mark.parametrize(("params", "field", "words"), INVALID, ids=lambda v: getattr(v, "kind", None))
def test_invalid_specs_are_refused_naming_the_field(backend, params, field: str, words: str) -> None:
    spec = GrammarSpec.of(params)
    with pytest.raises(InvalidRequestError) as refused:
        check(spec)
    assert refused.value.param == field and words in str(refused.value)
    assert str(refused.value).startswith(field) and "/project/" not in str(refused.value)


def test_compiled_grammars_are_cached_by_spec(backend) -> None:
    spec = GrammarSpec.of(StructuredOutputsParams(regex=r"cache-\d+"))
    hits = backend.cache.hits
    first = backend.compile(spec)
    assert backend.compile(GrammarSpec.of(StructuredOutputsParams(regex=r"cache-\d+"))) is first
    assert backend.cache.hits == hits + 1
    assert backend.compile(GrammarSpec.of(StructuredOutputsParams(regex=r"cache-\d*"))) is not first


def test_a_schema_dict_and_its_text_keep_property_order() -> None:
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "integer"}}}
    assert GrammarSpec.of(StructuredOutputsParams(json=schema)).text.index('"b"') < GrammarSpec.of(
        StructuredOutputsParams(json=schema)
    ).text.index('"a"')
    assert GrammarSpec.of(StructuredOutputsParams(json_object=True)) == GrammarSpec("json_object", "")


def test_the_grammars_vocabulary_stops_at_the_tokenizer_s() -> None:
    """A model vocabulary padded past the tokenizer's: the grammars and their masks cover the
    tokenizer's ids alone (xgrammar would scan the padding on every accept), and the mask pass
    refuses the padding as the grammar refuses it."""
    padded = GrammarBackend(byte_tokenizer(), VOCAB + 100, [EOS_ID])
    assert (padded.vocab_size, padded.mask_vocab_size, padded.tokenizer_info.vocab_size) == (VOCAB + 100, VOCAB, VOCAB)
    assert grammar_vocab_size(byte_tokenizer(), VOCAB - 6) == VOCAB - 6  # a model short of the tokenizer
    state = GrammarState(padded.compile(GrammarSpec.of(StructuredOutputsParams(regex="[ab]+"))))
    words = allocate_bitmask(1, padded.mask_vocab_size, pin_memory=False)
    GrammarBatch(num_threads=1).fill_bitmask([state], words)
    logits = torch.zeros(1, padded.vocab_size)
    apply_token_bitmask(logits, TokenBitmask(torch.tensor([0]), words))
    assert set(torch.nonzero(torch.isfinite(logits[0])).flatten().tolist()) == set(b"ab")
