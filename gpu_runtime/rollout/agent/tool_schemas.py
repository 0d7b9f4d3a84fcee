"""Each tool's OpenAI function schema, and what a call's JSON arguments become for the tool.

A model with a native tool-call format (``tool_parsers``) reads the tools' schemas in its prompt
(the chat template renders them) and writes JSON arguments. A tool still receives one string
(``Tool.__call__(arguments: str)``): the value of its single string parameter when its schema
has one (``calculator``: ``expression``, ``python``: ``code``, a tool without a schema:
``input``), else the arguments as canonical JSON. So a tool written for our tags works
unchanged with any format, and a tool that wants structured arguments declares a ``schema``
(the ``parameters`` JSON Schema) and parses the JSON it receives.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

import jsonschema

from gpu_runtime.rollout.agent.tool_api import Tool

DEFAULT_PARAMETER = "input"  # a tool without a schema takes one required string of this name


def default_parameters(name: str = DEFAULT_PARAMETER) -> dict:
    """One required string parameter ``name``: what the whole tag body or JSON value carries."""
    return {"type": "object", "properties": {name: {"type": "string"}}, "required": [name]}


def tool_schema(tool: Tool) -> dict:
    """The tool's OpenAI function schema (``{"type": "function", "function": {name, description,
    parameters}}``), from its ``schema`` and ``description`` attributes when it has them;
    ``ValueError`` naming the tool when its ``schema`` is no JSON Schema of an object."""
    parameters = getattr(tool, "schema", None)
    if parameters is None:
        parameters = default_parameters()
    if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
        raise ValueError(f"tool {tool.name!r}: schema must be a JSON Schema of an object, got {parameters!r}")
    try:
        jsonschema.validators.validator_for(parameters).check_schema(parameters)
    except jsonschema.SchemaError as e:
        raise ValueError(f"tool {tool.name!r}: schema is not a valid JSON Schema: {e.message}") from e
    description = getattr(tool, "description", None)
    function: dict = {"name": tool.name}
    if isinstance(description, str) and description:
        function["description"] = description
    function["parameters"] = parameters
    return {"type": "function", "function": function}


def tool_schemas(tools: Iterable[Tool]) -> list[dict]:
    return [tool_schema(t) for t in tools]


def parameters_of(schema: dict) -> dict:
    """The ``parameters`` JSON Schema, from a tool's OpenAI schema or from the parameters themselves."""
    if "function" in schema:
        return dict(schema["function"].get("parameters") or {"type": "object", "properties": {}})
    return schema


def schema_named(tools: Iterable[dict], name: str) -> dict | None:
    """The OpenAI schema of the tool ``name`` among ``tools``; ``None`` when none has that name."""
    return next((t for t in tools if t.get("function", {}).get("name") == name), None)


def string_parameter(schema: dict) -> str | None:
    """The name of the schema's single parameter when it is a required string (the one a tag's body
    or a tool's ``arguments`` string carries); ``None`` otherwise."""
    params = parameters_of(schema)
    props = params.get("properties") or {}
    required = params.get("required") or []
    if len(props) == 1 and list(props) == list(required) and (props[required[0]] or {}).get("type") == "string":
        return str(required[0])
    return None


def validate_arguments(schema: dict, arguments: dict) -> str:
    """"" when ``arguments`` satisfy the tool's schema (its OpenAI schema or its parameters), else
    one message naming the field (the model reads it as the call's error)."""
    params = parameters_of(schema)
    validator = jsonschema.validators.validator_for(params)(params)
    error = jsonschema.exceptions.best_match(validator.iter_errors(arguments))
    if error is None:
        return ""
    where = ".".join(str(p) for p in error.absolute_path)
    return f"invalid arguments: {where + ': ' if where else ''}{error.message}"


def arguments_text(schema: dict, arguments: dict) -> str:
    """What the tool's ``__call__(arguments: str)`` receives: the single string parameter's value
    (``calculator``'s expression), else the arguments as JSON with sorted keys."""
    key = string_parameter(schema)
    if key is not None and isinstance(arguments.get(key), str):
        return str(arguments[key])
    return json.dumps(arguments, sort_keys=True, ensure_ascii=False)
