"""The backend: specs checked without a tokenizer (errors name the field), compiled and cached."""

from __future__ import annotations

import pytest

from pagoda.errors import InvalidRequestError
from pagoda.sampling_params import StructuredOutputsParams
from pagoda.structured_output.backend import check
from pagoda.structured_output.spec import GrammarSpec

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
