"""A JSON schema with nested objects, arrays, enums and required fields, bounded the way a
client writes one for a small model (maxLength, maxItems, minimum / maximum), and its check."""

from __future__ import annotations

import json
from typing import Any

import jsonschema

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["red", "green", "blue"]},
                 "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 10},
                           "zip": {"type": "integer", "minimum": 10000, "maximum": 99999}},
            "required": ["city", "zip"],
        },
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "address", "active"],
}
SMALL_SCHEMA: dict[str, Any] = {  # ~20 tokens: for tests about the engine more than the schema
    "type": "object",
    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                   "kind": {"type": "string", "enum": ["a", "b", "c"]},
                   "note": {"type": "string", "maxLength": 6}},
    "required": ["id", "kind", "note"],
}
MAX_TOKENS = 150  # the schema's longest object is well under this

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 12},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"]}}},
    {"type": "function", "function": {
        "name": "add", "description": "Add two integers",
        "parameters": {"type": "object", "properties": {
            "a": {"type": "integer", "minimum": -1000, "maximum": 1000},
            "b": {"type": "integer", "minimum": -1000, "maximum": 1000}},
            "required": ["a", "b"]}}},
]

TOOLS_TEMPLATE = (  # a chat template that renders tools and tool calls (hermes)
    "{% if greeting %}{{ greeting }}\n{% endif %}{% if tools %}<|system|>\nTools:{% for t in tools %} {{ t.function.name }}"
    "{{ t.function.parameters | tojson }}{% endfor %}<|eos|>\n{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>\n{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "<tool_call>{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}"
    "</tool_call>{% endfor %}{% else %}{{ m.content }}{% endif %}<|eos|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
TOOL_MESSAGES = [{"role": "user", "content": "What is the weather in Oslo, and what is 2 + 3?"}]
TOOL_PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def check_json(text: str, schema: dict[str, Any] = SCHEMA) -> Any:
    """The parsed value; fails the test if the text is not JSON valid against ``schema``."""
    value = json.loads(text)
    jsonschema.validate(value, schema)
    return value
