"""Request fields that constrain the output, as the engine's StructuredOutputsParams: OpenAI's
`response_format` (json_schema, json_object; text asks for nothing), vLLM's `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar` and its newer `structured_outputs` object;
the Responses API's `text.format`. One constraint per request: two are a 400 naming both fields.

Sizes are bounded here, before anything compiles (a schema's characters and nesting, a
choice's count and length, a pattern's or grammar's length), and a schema's shape is checked
(every subschema an object or a boolean, keywords of the right JSON types), each failure
naming the field the client sent. Whether it compiles is the engine's to say: its
InvalidRequestError names `structured_outputs.<kind>`, which `Constraint.param_names` maps
back to the request's field."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pagoda.entrypoints.openai.errors import OpenAIError
from pagoda.entrypoints.openai.protocol import ConstraintFields
from pagoda.sampling_params import StructuredOutputsParams

# A schema's JSON text, and a pattern's or grammar's: far above any real one, far below what
# would cost the grammar compiler noticeable time.
MAX_SCHEMA_CHARS = 64 * 1024
MAX_SCHEMA_DEPTH = 32
MAX_PATTERN_CHARS = 16 * 1024
MAX_GRAMMAR_CHARS = 64 * 1024
MAX_CHOICES = 256
MAX_CHOICE_CHARS = 1024

JSON_TYPES = frozenset({"object", "array", "string", "number", "integer", "boolean", "null"})
# Keywords whose value is a schema, a list of schemas, or an object of schemas.
_SCHEMA_KEYWORDS = ("additionalProperties", "items", "not", "contains", "propertyNames", "if", "then", "else")
_SCHEMA_LIST_KEYWORDS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAP_KEYWORDS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


@dataclass(frozen=True)
class Constraint:
    params: StructuredOutputsParams
    field: str  # the request field it came from, for errors

    def param_names(self) -> dict[str, str]:
        """The engine's names of this constraint -> the field the client sent."""
        return {"structured_outputs": self.field, f"structured_outputs.{self.params.kind}": self.field}


def request_constraint(body: ConstraintFields) -> Constraint | None:
    """The request's one constraint (None: free text)."""
    found = [constraint for constraint in _constraints(body) if constraint is not None]
    if len(found) > 1:
        first, second = found[0].field, found[1].field
        raise OpenAIError(400, f"{first} and {second} each constrain the output: send one of them", first)
    return found[0] if found else None


def _constraints(body: ConstraintFields) -> list[Constraint | None]:
    """Every constraint the request's fields ask for, in field order."""
    found = []
    response_format = body.response_format
    if response_format is not None and response_format.type == "json_object":
        found.append(json_object("response_format"))
    if response_format is not None and response_format.json_schema is not None:
        schema = response_format.json_schema.json_schema
        field = "response_format.json_schema.schema"
        found.append(json_constraint(schema, field) if schema is not None else json_object("response_format"))
    if body.guided_json is not None:
        found.append(json_constraint(body.guided_json, "guided_json"))
    found.append(_text_constraint("regex", body.guided_regex, "guided_regex"))
    found.append(_choice_constraint(body.guided_choice, "guided_choice"))
    found.append(_text_constraint("grammar", body.guided_grammar, "guided_grammar"))
    outputs = body.structured_outputs
    if outputs is not None:
        keys = {
            "json": outputs.json_schema,
            "json_object": outputs.json_object or None,
            "regex": outputs.regex,
            "choice": outputs.choice,
            "grammar": outputs.grammar,
        }
        given = [key for key, value in keys.items() if value is not None]
        if len(given) != 1:
            raise OpenAIError(
                400,
                f"structured_outputs must set exactly one of {list(keys)}, got {given or 'none'}",
                "structured_outputs",
            )
        key = given[0]
        field = f"structured_outputs.{key}"
        if key == "json":
            found.append(json_constraint(outputs.json_schema, field))
        elif key == "json_object":
            found.append(json_object(field))
        elif key == "choice":
            found.append(_choice_constraint(outputs.choice, field))
        else:
            found.append(_text_constraint(key, keys[key], field))
    return found


def text_format_constraint(text_format: dict[str, Any] | None) -> Constraint | None:
    """The Responses API's `text.format`: {"type": "json_schema", "name", "schema", "strict"}
    (the schema sits in the format itself, not under `json_schema`) or {"type": "json_object"};
    {"type": "text"} asks for nothing."""
    kind = None if text_format is None else text_format.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return json_object("text.format")
    if kind != "json_schema":
        raise OpenAIError(
            400, f"text.format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}", "text.format.type"
        )
    assert text_format is not None
    if "schema" not in text_format:
        raise OpenAIError(400, "text.format.schema is required with type 'json_schema'", "text.format.schema")
    return json_constraint(text_format["schema"], "text.format.schema")


def json_object(field: str) -> Constraint:
    return Constraint(StructuredOutputsParams(json_object=True), field)


def json_constraint(schema: dict[str, Any] | str, field: str) -> Constraint:
    """A JSON schema given as an object or as its JSON text, checked for size and shape."""
    if isinstance(schema, str):
        if len(schema) > MAX_SCHEMA_CHARS:
            raise _too_long(field, "JSON schema", len(schema), MAX_SCHEMA_CHARS)
        try:
            schema = json.loads(schema)
        except ValueError as error:
            raise OpenAIError(400, f"{field} must be a JSON schema; its text is not JSON: {error}", field) from None
    check_schema(schema, field)
    return Constraint(StructuredOutputsParams(json=schema), field)


def check_schema(schema: Any, field: str) -> None:
    """A JSON schema within the size bounds and of the right shape (400 naming where it is not)."""
    if not isinstance(schema, dict):
        raise OpenAIError(400, f"{field} must be a JSON schema object, got {type(schema).__name__}", field)
    try:
        size = len(json.dumps(schema))
    except RecursionError:
        raise OpenAIError(400, f"{field}: the schema nests deeper than {MAX_SCHEMA_DEPTH} levels", field) from None
    if size > MAX_SCHEMA_CHARS:
        raise _too_long(field, "JSON schema", size, MAX_SCHEMA_CHARS)
    _check_subschema(schema, field, 0)


def _check_subschema(schema: Any, path: str, depth: int) -> None:
    if depth > MAX_SCHEMA_DEPTH:
        raise OpenAIError(400, f"{path}: the schema nests deeper than {MAX_SCHEMA_DEPTH} levels", path)
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise OpenAIError(400, f"{path} must be a schema (an object or a boolean), got {json.dumps(schema)[:80]}", path)
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind]
    if kind is not None and not all(isinstance(k, str) and k in JSON_TYPES for k in kinds):
        raise OpenAIError(
            400, f"{path}.type must be one of {sorted(JSON_TYPES)} (or a list of them), got {kind!r}", f"{path}.type"
        )
    required = schema.get("required")
    if required is not None and not (isinstance(required, list) and all(isinstance(r, str) for r in required)):
        raise OpenAIError(400, f"{path}.required must be a list of property names", f"{path}.required")
    if "enum" in schema and not isinstance(schema["enum"], list):
        raise OpenAIError(400, f"{path}.enum must be a list of values", f"{path}.enum")
    for keyword in _SCHEMA_KEYWORDS:
        if keyword in schema and not (keyword == "items" and isinstance(schema[keyword], list)):
            _check_subschema(schema[keyword], f"{path}.{keyword}", depth + 1)
    for keyword in (*_SCHEMA_LIST_KEYWORDS, *(("items",) if isinstance(schema.get("items"), list) else ())):
        if keyword in schema:
            if not isinstance(schema[keyword], list) or not schema[keyword]:
                raise OpenAIError(400, f"{path}.{keyword} must be a non-empty list of schemas", f"{path}.{keyword}")
            for i, item in enumerate(schema[keyword]):
                _check_subschema(item, f"{path}.{keyword}[{i}]", depth + 1)
    for keyword in _SCHEMA_MAP_KEYWORDS:
        if keyword in schema:
            if not isinstance(schema[keyword], dict):
                raise OpenAIError(400, f"{path}.{keyword} must be an object of schemas", f"{path}.{keyword}")
            for name, item in schema[keyword].items():
                _check_subschema(item, f"{path}.{keyword}.{name}", depth + 1)


def _text_constraint(kind: str, value: str | None, field: str) -> Constraint | None:
    if value is None:
        return None
    limit = MAX_GRAMMAR_CHARS if kind == "grammar" else MAX_PATTERN_CHARS
    if len(value) > limit:
        raise _too_long(field, kind, len(value), limit)
    if not value:
        raise OpenAIError(400, f"{field} must not be empty", field)
    return Constraint(StructuredOutputsParams(**{kind: value}), field)


def _choice_constraint(choices: list[str] | None, field: str) -> Constraint | None:
    if choices is None:
        return None
    if not 1 <= len(choices) <= MAX_CHOICES:
        raise OpenAIError(400, f"{field} must list 1 to {MAX_CHOICES} choices, got {len(choices)}", field)
    for i, choice in enumerate(choices):
        if not 1 <= len(choice) <= MAX_CHOICE_CHARS:
            raise OpenAIError(
                400, f"{field}[{i}] must have 1 to {MAX_CHOICE_CHARS} characters, got {len(choice)}", f"{field}[{i}]"
            )
    return Constraint(StructuredOutputsParams(choice=list(choices)), field)


def _too_long(field: str, what: str, size: int, limit: int) -> OpenAIError:
    return OpenAIError(400, f"{field}: the {what} has {size} characters; at most {limit} are accepted", field)
