"""`finite_value_problem`: schemas with no finite JSON value are found; every schema JSON Schema
gives a value passes (checked against pydantic's recursive models and `jsonschema` instances)."""

from __future__ import annotations

from typing import Any

import jsonschema
import pytest
from pydantic import BaseModel

from tandem.engine.structured.schema_check import finite_value_problem


class Tree(BaseModel):
    name: str
    children: list[Tree]  # an empty list ends it


class Chain(BaseModel):
    value: int
    next: Chain | None  # required, but may be null


@pytest.mark.parametrize(
    "schema",
    [
        {"$defs": {"A": {"$ref": "#/$defs/B"}, "B": {"$ref": "#/$defs/A"}}, "$ref": "#/$defs/A"},
        {"type": "object", "properties": {"child": {"$ref": "#"}}, "required": ["child"]},
        {"type": "array", "items": {"$ref": "#"}, "minItems": 1},
        {
            "definitions": {
                "N": {"type": "object", "properties": {"n": {"$ref": "#/definitions/N"}}, "required": ["n"]}
            },
            "type": "object",
            "properties": {"root": {"$ref": "#/definitions/N"}},
            "required": ["root"],
        },
        {"anyOf": [{"$ref": "#"}, {"$ref": "#"}]},
        {"type": "object", "properties": {"a": False}, "required": ["a"]},
        {"enum": []},
        {"type": "object", "required": ["x"], "additionalProperties": False},
    ],
)
def test_no_finite_value_is_found(schema: dict[str, Any]) -> None:
    assert finite_value_problem(schema) is not None


@pytest.mark.parametrize(
    ("schema", "instance"),
    [
        (Tree.model_json_schema(), {"name": "a", "children": []}),
        (Chain.model_json_schema(), {"value": 1, "next": None}),
        ({"type": "object", "properties": {"child": {"$ref": "#"}}}, {}),
        (
            {
                "anyOf": [
                    {"type": "string"},
                    {"type": "object", "properties": {"c": {"$ref": "#"}}, "required": ["c"]},
                ]
            },
            "x",
        ),
        ({"type": ["object", "null"], "properties": {"c": {"$ref": "#"}}, "required": ["c"]}, None),
        ({"type": "array", "items": {"$ref": "#"}}, []),
        ({"$defs": {"A": {"$ref": "#/$defs/B"}, "B": {"type": "integer"}}, "$ref": "#/$defs/A"}, 3),
        ({"properties": {"c": {"$ref": "#"}}, "required": ["c"]}, 5),  # untyped: 5 is valid
        (
            {
                "type": "object",
                "properties": {"a~b/c": {"type": "string"}, "d": {"$ref": "#/properties/a~0b~1c"}},
                "required": ["d"],
            },
            {"d": "x"},
        ),
    ],
)
def test_a_schema_with_a_value_passes(schema: dict[str, Any], instance: Any) -> None:
    jsonschema.validate(instance, schema)  # the reference: the instance is valid
    assert finite_value_problem(schema) is None


def test_a_deeply_nested_schema_is_a_problem_not_a_crash() -> None:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(5000):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    assert finite_value_problem(schema) is not None
