"""`GrammarBackend`: xgrammar for one tokenizer — its token table, built once, and the compiler.

JSON schemas compile with whitespace fixed (separators ", " and ": ", no free whitespace), so a
model cannot fill its budget with blanks (the endless-whitespace failure of unbounded JSON
grammars); `json_object` is the schema {"type": "object"} under the same rule. A choice is a
grammar of its literal strings. The grammar's stop tokens are the model's eos ids: a grammar at
its end allows only them, and sampling one ends the request with finish reason "stop".

One backend per tokenizer and process (`get_backend`): the engine core's compile threads and a
model runner in the same process share it and its cache, so the runner finds every grammar the
core compiled. `check` parses a spec without the tokenizer (milliseconds), for the front end.
"""

from __future__ import annotations

import json
import logging
import re
import threading

import xgrammar as xgr
from transformers import PreTrainedTokenizerBase

from pagoda.config import ModelConfig
from pagoda.errors import InvalidRequestError
from pagoda.structured_output.cache import CompileCache
from pagoda.structured_output.spec import GrammarSpec

logger = logging.getLogger(__name__)

# xgrammar prefixes its C++ errors with a time and a source location.
_ERROR_PREFIX = re.compile(r"^\[[\d:]+\] [^ ]+: (Check failed: \(.*?\) is false: )?")
_JSON_OPTIONS = {"any_whitespace": False, "separators": (", ", ": ")}
JSON_OBJECT_SCHEMA = '{"type": "object"}'


def invalid(spec: GrammarSpec, error: Exception) -> InvalidRequestError:
    """The request error for a spec the grammar engine refused, naming the field."""
    message = _ERROR_PREFIX.sub("", str(error).strip())
    return InvalidRequestError(spec.field, f"{spec.field} is not a valid {_WHAT[spec.kind]}: {message}")


_WHAT = {
    "json": "JSON schema",
    "json_object": "JSON object constraint",
    "regex": "regular expression",
    "choice": "choice",
    "grammar": "EBNF grammar",
}


def _choice_ebnf(text: str) -> str:
    # JSON string literals are EBNF string literals in xgrammar's syntax (same escapes).
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in json.loads(text))


def check(spec: GrammarSpec) -> None:
    """Raise InvalidRequestError (naming the field) unless the spec parses; needs no tokenizer."""
    try:
        if spec.kind == "json":
            json.loads(spec.text)  # a clearer message than the engine's for text that is not JSON
            xgr.Grammar.from_json_schema(spec.text, **_JSON_OPTIONS)
        elif spec.kind == "regex":
            xgr.Grammar.from_regex(spec.text)
        elif spec.kind == "grammar":
            xgr.Grammar.from_ebnf(spec.text)
        elif spec.kind == "choice":
            xgr.Grammar.from_ebnf(_choice_ebnf(spec.text))
    except (RuntimeError, ValueError) as error:
        raise invalid(spec, error) from error


class GrammarBackend:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, stop_token_ids: list[int]) -> None:
        # vocab_size is the model's (its logits' width), which may pad past the tokenizer's.
        self.vocab_size = vocab_size
        self.mask_vocab_size = grammar_vocab_size(tokenizer, vocab_size)
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=self.mask_vocab_size, stop_token_ids=sorted(stop_token_ids)
        )
        self.compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=2, cache_enabled=False)
        self.cache: CompileCache[xgr.CompiledGrammar] = CompileCache()

    @property
    def stop_token_ids(self) -> list[int]:
        return list(self.tokenizer_info.stop_token_ids)

    def compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        """The compiled grammar (cached); InvalidRequestError naming the field if it does not compile."""
        return self.cache.get_or_compile(spec, lambda: self._compile(spec))

    def _compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        try:
            if spec.kind == "json":
                return self.compiler.compile_json_schema(spec.text, **_JSON_OPTIONS)
            if spec.kind == "json_object":
                return self.compiler.compile_json_schema(JSON_OBJECT_SCHEMA, **_JSON_OPTIONS)
            if spec.kind == "regex":
                return self.compiler.compile_regex(spec.text)
            if spec.kind == "choice":
                return self.compiler.compile_grammar(_choice_ebnf(spec.text))
            return self.compiler.compile_grammar(spec.text)
        except (RuntimeError, ValueError) as error:
            raise invalid(spec, error) from error


def grammar_vocab_size(tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> int:
    """The ids the grammars see: the tokenizer's (as xgrammar counts them), at most the model's.

    The model's ids past the tokenizer's are padding that no grammar allows; left to xgrammar,
    they would be special tokens, which its accept scans linearly for every token: 102,784
    padding ids (SmolLM2's tokenizer on Qwen3's vocabulary) made an accept ~25 us, 4x the
    grammar's own work. The masks cover these ids alone; the mask pass refuses those past them."""
    ids = tokenizer.get_vocab().values()
    return min(vocab_size, max(len(ids), 1 + max(ids, default=-1)))


_backends: dict[tuple[str, str, str | None, int], GrammarBackend] = {}
_backends_lock = threading.Lock()


def get_backend(model_config: ModelConfig) -> GrammarBackend:
    """This process's backend for the model's tokenizer, built at the first call (the token
    table: a fraction of a second for a 49k vocabulary) and shared by later ones."""
    from pagoda.model.loader import get_eos_token_ids, load_tokenizer

    config = model_config
    key = (config.model, config.load_format, config.tokenizer, config.vocab_size)
    with _backends_lock:
        if key not in _backends:
            tokenizer = load_tokenizer(config.model, config.load_format, config.tokenizer)
            if tokenizer is None:
                raise InvalidRequestError(
                    "structured_outputs", "structured_outputs need a tokenizer; this model has none"
                )
            eos_token_ids = get_eos_token_ids(config.model, config.load_format, config.hf_config, tokenizer)
            backend = GrammarBackend(tokenizer, config.vocab_size, sorted(eos_token_ids))
            logger.info(
                "grammar backend: xgrammar, vocabulary %d (the grammars' %d), stop ids %s",
                config.vocab_size,
                backend.mask_vocab_size,
                sorted(eos_token_ids),
            )
            _backends[key] = backend
        return _backends[key]
