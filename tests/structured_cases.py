"""JSON schemas for the structured-output tests and the benchmark: nested objects, arrays, enums, required and
optional fields, bounded numbers, patterned and bounded strings. Free strings carry a maxLength, so that even a
random model (which picks among allowed tokens almost uniformly) closes them soon."""
from __future__ import annotations

from typing import Any


def obj(props: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required,
            "additionalProperties": False}


S = {"type": "string", "maxLength": 6}
INT = {"type": "integer", "minimum": -50, "maximum": 50}

SCHEMAS: list[dict[str, Any]] = [
    obj({"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
    obj({"label": {"enum": ["positive", "negative", "neutral"]}}),
    obj({"label": {"enum": ["a", "b"]}, "score": {"type": "number", "minimum": 0, "maximum": 1}}),
    obj({"ok": {"type": "boolean"}}),
    obj({"id": {"type": "string", "pattern": "^[a-z]{3}[0-9]{2}$"}}),
    obj({"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}, "n": INT}),
    obj({"tags": {"type": "array", "items": {"enum": ["x", "y", "z"]}, "minItems": 1, "maxItems": 3}}),
    obj({"xs": {"type": "array", "items": INT, "maxItems": 4}}),
    obj({"user": obj({"id": INT, "name": S})}),
    obj({"a": obj({"b": obj({"c": {"type": "boolean"}})})}),
    obj({"items": {"type": "array", "items": obj({"sku": S, "qty": {"type": "integer", "minimum": 1, "maximum": 9}}),
                   "maxItems": 2}}),
    obj({"name": S, "nick": S}, required=["name"]),
    obj({"x": {"type": "number", "minimum": -1, "maximum": 1}, "y": {"type": "number", "minimum": -1, "maximum": 1}}),
    obj({"level": {"type": "integer", "enum": [1, 2, 3]}}),
    obj({"color": {"enum": ["red", "green", "blue"]}, "alpha": {"type": "number", "minimum": 0, "maximum": 1}},
        required=["color"]),
    obj({"date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}}),
    obj({"v": {"type": ["integer", "null"], "minimum": 0, "maximum": 9}}),
    obj({"kind": {"const": "point"}, "x": INT, "y": INT}),
    obj({"matrix": {"type": "array", "items": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                             "maximum": 9}, "maxItems": 2},
                    "maxItems": 2}}),
    obj({"pct": {"type": "integer", "minimum": 0, "maximum": 100}, "ok": {"type": "boolean"}}),
    obj({"word": {"type": "string", "minLength": 2, "maxLength": 4}}),
    obj({"answer": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"enum": ["none"]}]}}),
    obj({"email": {"type": "string", "pattern": "^[a-z]{1,5}@[a-z]{1,5}\\.(com|org)$"}}),
    obj({"meta": obj({"version": {"type": "integer", "minimum": 1, "maximum": 3}, "draft": {"type": "boolean"}}),
         "title": S}),
    obj({"pair": {"type": "array", "prefixItems": [INT, {"type": "boolean"}], "items": False, "minItems": 2}}),
    obj({"grade": {"enum": ["A", "B", "C", "D", "F"]}, "pass": {"type": "boolean"}}),
    obj({"temp": {"type": "number", "minimum": -40, "maximum": 50}, "unit": {"enum": ["C", "F"]}}),
    obj({"ids": {"type": "array", "items": {"type": "string", "pattern": "^[0-9]{3}$"}, "minItems": 1,
                 "maxItems": 3}}),
    obj({"owner": obj({"name": S, "age": {"type": "integer", "minimum": 18, "maximum": 99}}),
         "pets": {"type": "array", "items": obj({"species": {"enum": ["cat", "dog"]}}), "maxItems": 2}}),
    obj({"yes": {"type": "boolean"}, "no": {"type": "boolean"}}, required=["yes"]),
    obj({"hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}}),
    obj({"n": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10}}),
    obj({"status": {"enum": ["open", "closed"]}, "count": {"type": "integer", "minimum": 0, "maximum": 5},
         "note": S}, required=["status"]),
    obj({"flags": {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 2}}),
]
