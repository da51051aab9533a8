"""The base of the request models: strict pydantic, with OpenAI's leniency and no more."""

from __future__ import annotations

from types import NoneType, UnionType
from typing import Any, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, GetJsonSchemaHandler, model_validator
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema

_META = ("title", "default", "description", "examples", "deprecated")


def _takes(annotation: Any, kind: type) -> bool:
    """Whether a field's type is ``kind`` or a union with it."""
    if annotation is kind:
        return True
    return get_origin(annotation) in (Union, UnionType) and kind in get_args(annotation)


class StrictModel(BaseModel):
    """Strict types, unknown fields refused, and OpenAI's leniency, no more: a ``null`` for a
    field whose type has no null means its default (``"n": null`` is ``n=1``), and an integral
    float is an integer for an integer field (``"seed": 1.0``; ``1.5`` stays a 400)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _openai_leniency(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        out = dict(data)
        for name, field in cls.model_fields.items():
            key = field.alias or name
            if key not in out:
                continue
            value = out[key]
            if value is None and not field.is_required() and not _takes(field.annotation, NoneType):
                del out[key]
            elif (isinstance(value, float) and value.is_integer() and _takes(field.annotation, int)
                  and not _takes(field.annotation, float)):
                out[key] = int(value)
        return out


    @classmethod
    def __get_pydantic_json_schema__(cls, core_schema: CoreSchema,
                                     handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        """The document says what the leniency accepts: a field whose ``null`` means its default
        is ``anyOf [its type, null]`` (an integral float already is a JSON Schema integer)."""
        schema = handler.resolve_ref_schema(handler(core_schema))
        props = schema.get("properties", {})
        for name, field in cls.model_fields.items():
            prop = props.get(field.alias or name)
            if prop is None or field.is_required() or _takes(field.annotation, NoneType):
                continue
            meta = {k: prop.pop(k) for k in _META if k in prop}
            props[field.alias or name] = {"anyOf": [prop, {"type": "null"}], **meta}
        return schema
