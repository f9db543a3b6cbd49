"""50 JSON schemas for constrained decoding (issue 29, acceptance 1), and 20 bad constraints.

Every schema bounds its documents (``maxLength``, ``maxItems``, ``enum``, ``pattern``,
``additionalProperties: false``) so that a random model sampling at temperature 1 finishes
a document inside the tiny test models' context of 96 positions (a number's fraction is
bounded by ``multipleOf`` but in one schema, whose documents this model keeps short).
"""

from __future__ import annotations

from typing import Any

S: dict[str, Any] = {"type": "string", "maxLength": 3}
INT: dict[str, Any] = {"type": "integer", "minimum": -50, "maximum": 50}


def obj(properties: dict[str, Any], required: list[str] | None = None, **more: Any) -> dict[str, Any]:
    """An object schema with exactly these properties (all required unless ``required`` says)."""
    req = list(properties) if required is None else required
    return {"type": "object", "properties": properties, "required": req, "additionalProperties": False, **more}


SCHEMAS: list[dict[str, Any]] = [
    # -- objects and scalar types
    obj({"a": S}),
    obj({"a": INT}),
    obj({"a": {"type": "boolean"}}),
    obj({"a": {"type": "null"}}),
    obj({"a": S, "b": INT, "c": {"type": "boolean"}}),
    obj({"n": {"type": "number", "minimum": 0, "maximum": 1}}),
    obj(
        {
            "x": {"type": "number", "minimum": -5.5, "maximum": 5.5, "multipleOf": 0.25},
            "y": {"type": "integer", "minimum": 0, "maximum": 99},
        }
    ),
    obj({"v": {"type": ["string", "integer"], "maxLength": 2, "minimum": 0, "maximum": 9}}),
    obj({"id": {"type": "integer", "minimum": 100, "maximum": 999}}),
    obj({"t": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10}}),
    # -- enums and consts
    obj({"colour": {"enum": ["red", "green", "blue"]}}),
    obj({"k": {"enum": [1, 2, 3, "four", None, True]}}),
    obj({"kind": {"const": "point"}, "x": INT}),
    {"enum": ["alpha", "beta", "gamma"]},
    obj(
        {"unit": {"enum": ["C", "F"]}, "value": {"type": "number", "minimum": -100, "maximum": 100, "multipleOf": 0.5}}
    ),
    # -- required and optional fields
    obj({"a": S, "b": S}, required=["a"]),
    obj({"a": INT, "b": INT, "c": INT}, required=[]),
    obj({"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 120}, "nick": S}, required=["name"]),
    obj({"p": {"type": "boolean"}, "q": {"type": "boolean"}}, required=["q"]),
    obj({"first": S, "last": S, "middle": S}, required=["first", "last"]),
    # -- arrays, nested arrays
    {"type": "array", "items": INT, "maxItems": 4},
    {"type": "array", "items": S, "minItems": 1, "maxItems": 3},
    obj({"xs": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}}),
    obj({"m": {"type": "array", "items": {"type": "array", "items": INT, "maxItems": 2}, "maxItems": 2}}),
    obj({"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 2, "maxItems": 3}}),
    {"type": "array", "items": obj({"k": S}), "maxItems": 2},
    obj(
        {"grid": {"type": "array", "items": {"type": "array", "items": {"enum": [0, 1]}, "maxItems": 3}, "maxItems": 3}}
    ),
    {"type": "array", "prefixItems": [INT, S], "items": False},
    obj({"pairs": {"type": "array", "items": obj({"k": {"enum": ["x", "y"]}, "v": INT}), "maxItems": 2}}),
    obj(
        {
            "deep": {
                "type": "array",
                "items": {"type": "array", "items": {"type": "array", "items": INT, "maxItems": 1}, "maxItems": 2},
                "maxItems": 1,
            }
        }
    ),
    # -- nested objects
    obj({"inner": obj({"a": INT})}),
    obj({"a": obj({"b": obj({"c": S})})}),
    obj({"pos": obj({"x": INT, "y": INT}), "ok": {"type": "boolean"}}),
    obj({"meta": obj({"v": {"enum": [1, 2]}, "note": S}, required=["v"])}),
    obj({"user": obj({"name": S, "roles": {"type": "array", "items": {"enum": ["r", "w"]}, "maxItems": 2}})}),
    # -- $ref definitions
    {"$defs": {"p": obj({"x": INT, "y": INT})}, **obj({"a": {"$ref": "#/$defs/p"}, "b": {"$ref": "#/$defs/p"}})},
    {
        "definitions": {"c": {"enum": ["r", "g", "b"]}},
        **obj({"fg": {"$ref": "#/definitions/c"}, "bg": {"$ref": "#/definitions/c"}}),
    },
    {"$defs": {"s": S}, "type": "array", "items": {"$ref": "#/$defs/s"}, "maxItems": 3},
    {
        "$defs": {"leaf": obj({"v": INT}), "node": obj({"l": {"$ref": "#/$defs/leaf"}, "r": {"$ref": "#/$defs/leaf"}})},
        **obj({"root": {"$ref": "#/$defs/node"}}),
    },
    {
        "$defs": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
        **obj({"d": {"type": "array", "items": {"$ref": "#/$defs/n"}, "maxItems": 4}}),
    },
    # -- string patterns and formats
    obj({"code": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"}}),
    obj({"date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}}),
    obj({"hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}}),
    obj({"word": {"type": "string", "pattern": "^(yes|no|maybe)$"}, "n": INT}),
    obj({"s": {"type": "string", "minLength": 2, "maxLength": 4}}),
    obj({"ip": {"type": "string", "pattern": "^[0-9]{1,3}\\.[0-9]{1,3}\\.[0-9]{1,3}\\.[0-9]{1,3}$"}}),
    # -- combinations
    {"anyOf": [obj({"a": INT}), obj({"b": S})]},
    {"oneOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"enum": ["none"]}]},
    obj({"v": {"anyOf": [{"type": "null"}, INT]}, "w": {"allOf": [{"type": "integer"}, {"minimum": 1, "maximum": 3}]}}),
    obj(
        {
            "shape": {"enum": ["sq", "ci"]},
            "size": {"type": "number", "minimum": 0, "maximum": 10, "multipleOf": 0.5},
            "pts": {"type": "array", "items": obj({"x": INT}), "maxItems": 2},
        }
    ),
]

#: (SamplingParams field, value, why it is refused). Each is an InvalidInputError naming the field at
#: submit: when SamplingParams is built (type errors) or when the grammar compiles (the rest).
BAD_CONSTRAINTS: list[tuple[str, Any, str]] = [
    ("json_schema", "{not json", "not JSON"),
    ("json_schema", ["type", "object"], "not an object"),
    ("json_schema", {"type": "strnig"}, "unknown type"),
    ("json_schema", {"type": 5}, "type not a string"),
    ("json_schema", {"required": "a"}, "required not a list"),
    ("json_schema", {"properties": {"a": {"$ref": "#/$defs/missing"}}}, "dangling $ref"),
    ("json_schema", {"$ref": "http://example.com/schema.json"}, "remote $ref"),
    ("json_schema", {"type": "string", "pattern": "(["}, "bad pattern"),
    ("json_schema", {"type": "integer", "minimum": 5, "maximum": 1}, "unsatisfiable bounds"),
    ("json_schema", {"if": {"type": "string"}, "then": {"maxLength": 2}}, "unsupported keyword"),
    ("json_schema", {"type": "string", "format": "not-a-format"}, "unknown format"),
    ("json_schema", {"enum": []}, "empty enum"),
    ("regex", "([a-z]", "unclosed group"),
    ("regex", "(?<=a)b", "look-behind"),
    ("regex", "", "empty"),
    ("choice", [], "no choices"),
    ("choice", ["ok", 3], "not strings"),
    ("grammar", "start: undefined_rule", "unknown rule"),
    ("grammar", 'root ::= "a" | missing', "GBNF with an unknown rule"),
    ("grammar", "start: /[/", "bad regex terminal"),
]
