"""Structured output on the HTTP API: OpenAI's ``response_format`` and vLLM's extensions ->
``common_pb2.StructuredOutput``.

Accepted, one at a time (two of them in one request is a 400 naming the second):

* ``response_format``: ``{"type": "text"}`` (free text), ``{"type": "json_object"}``,
  ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}``;
* ``structured_outputs`` (vLLM): ``{"json": schema}``, ``{"regex": str}``, ``{"choice": [str]}``,
  ``{"grammar": str}`` (Lark, or GBNF), ``{"json_object": true}``;
* vLLM's older ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``.

Shapes are checked here (a 400 naming the JSON path); whether a schema, regex or grammar is a
usable language is the language worker's to say (its refusal names the same path).
"""

from __future__ import annotations

import json
from typing import Any

from protos.epd.v1 import common_pb2
from services.gateway.http.errors import invalid

# vLLM's ``structured_outputs`` keys and the older top-level fields -> the proto's kinds
STRUCTURED_KEYS = {
    "json": "json_schema",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
    "json_object": "json_object",
}
GUIDED_FIELDS = {
    "guided_json": "json_schema",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def structured_output(body: Any) -> tuple[common_pb2.StructuredOutput | None, str]:
    """The structured output ``body`` asks for (None: free text) and the JSON path naming it."""
    found: list[tuple[str, str, Any]] = []  # (JSON path, kind, value)
    fmt = body.response_format
    if fmt is not None:
        found += _response_format(fmt)
    if body.structured_outputs is not None:
        asked = body.structured_outputs.model_dump(by_alias=True, exclude_none=True)
        for key, value in asked.items():
            if key not in STRUCTURED_KEYS or (key == "json_object" and value is False):
                continue  # vLLM's other options (backend choices and the like) change nothing
            found.append((f"structured_outputs.{key}", STRUCTURED_KEYS[key], value))
    extra = body.model_extra or {}
    for name, kind in GUIDED_FIELDS.items():
        value = extra.get(name)
        if value is not None:
            found.append((name, kind, value))
    if not found:
        return None, ""
    if len(found) > 1:
        raise invalid(
            f"{found[1][0]}: only one structured output may be asked for, and {found[0][0]} "
            "already is",
            found[1][0],
        )
    path, kind, value = found[0]
    return _proto(path, kind, value), path


def _response_format(fmt: dict) -> list[tuple[str, str, Any]]:
    kind = fmt.get("type")
    if kind == "text":
        return []
    if kind == "json_object":
        return [("response_format", "json_object", True)]
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise invalid(
                "response_format.json_schema must be an object with a 'schema'",
                "response_format.json_schema",
            )
        if "schema" not in spec:
            raise invalid(
                "response_format.json_schema.schema is required",
                "response_format.json_schema.schema",
            )
        return [("response_format.json_schema.schema", "json_schema", spec["schema"])]
    raise invalid(
        f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
        "response_format.type",
    )


def _proto(path: str, kind: str, value: Any) -> common_pb2.StructuredOutput:
    out = common_pb2.StructuredOutput()
    if kind == "json_object":
        if value is not True:
            raise invalid(f"{path} must be true", path)
        out.json_object = True
    elif kind == "json_schema":
        if isinstance(value, str):  # a schema sent as JSON text
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise invalid(f"{path} is not valid JSON: {exc}", path) from None
        if not isinstance(value, (dict, bool)):
            raise invalid(f"{path} must be a JSON schema (an object)", path)
        out.json_schema = json.dumps(value)
    elif kind == "choice":
        if not isinstance(value, list) or not value:
            raise invalid(f"{path} must be a non-empty list of strings", path)
        for i, choice in enumerate(value):
            if not isinstance(choice, str) or not choice:
                raise invalid(f"{path}[{i}] must be a non-empty string", f"{path}[{i}]")
        out.choice.choices.extend(value)
    else:  # regex, grammar
        if not isinstance(value, str) or not value:
            raise invalid(f"{path} must be a non-empty string", path)
        setattr(out, kind, value)
    return out
