"""ToolSet: a chat request's tools, tool_choice and parallel_tool_calls, validated at the door.

OpenAI's shapes: `tools` is a list of {"type": "function", "function": {"name", "description",
"parameters", "strict"}}; `tool_choice` is "none", "auto" (the default when tools are given),
"required" or {"type": "function", "function": {"name"}}. Everything a client could get wrong is
a 400 naming the field: a missing or malformed name (OpenAI's ^[a-zA-Z0-9_-]{1,64}$), two tools
with one name, parameters that are not an object schema, a tool_choice naming no given tool.

Two choices where OpenAI's API is silent or where small local models need a firmer hand:
`parallel_tool_calls` defaults to false, as in llama.cpp's server (a 135M model asked for "one
or more" calls repeats the same call until max_tokens); and an object schema in the parameters
that does not say otherwise admits no properties beyond those it lists, so `f(**arguments)` does
not break on an invented keyword (`closed_objects`, which Ollama's `format` schemas go through too).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tokios.errors import InvalidRequestError

TOOL_NAME_PATTERN = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
CHOICE_MODES = ("none", "auto", "required")
# A function without `parameters` takes no arguments (OpenAI): the empty object.
NO_PARAMETERS_SCHEMA: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True)
class Function:
    name: str
    description: str | None
    parameters: dict[str, Any]

    def as_tool(self) -> dict[str, Any]:
        """The OpenAI tool object (what templates that take `tools` expect)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolSet:
    functions: tuple[Function, ...]
    # "none", "auto", "required", or "function" (with `forced_name`).
    mode: str
    forced_name: str | None = None
    parallel: bool = True
    by_name: dict[str, Function] = field(default_factory=dict, compare=False)

    @property
    def calls_possible(self) -> bool:
        return self.mode != "none"

    @property
    def calls_required(self) -> bool:
        return self.mode in ("required", "function")

    @property
    def callable_functions(self) -> tuple[Function, ...]:
        """The functions the grammar lets the model call (the named one alone when forced)."""
        if self.mode == "function":
            return (self.by_name[self.forced_name],)
        return self.functions

    @classmethod
    def from_request(cls, tools: Any, tool_choice: Any, parallel_tool_calls: Any) -> ToolSet | None:
        """None when the request gives no tools (then tool_choice may only be absent or 'none')."""
        if parallel_tool_calls is None:
            parallel_tool_calls = False
        if not isinstance(parallel_tool_calls, bool):
            raise InvalidRequestError("parallel_tool_calls must be true or false", param="parallel_tool_calls")
        if tools is None or tools == []:
            if tool_choice not in (None, "none"):
                raise InvalidRequestError("tool_choice needs tools: the request gives none", param="tool_choice")
            return None
        if not isinstance(tools, list):
            raise InvalidRequestError("tools must be a list of {type: 'function', function: {...}}", param="tools")
        functions = tuple(_function(tool, index) for index, tool in enumerate(tools))
        by_name: dict[str, Function] = {}
        for index, function in enumerate(functions):
            if function.name in by_name:
                raise InvalidRequestError(f"tools[{index}].function.name {function.name!r} is given twice",
                                          param=f"tools[{index}].function.name")
            by_name[function.name] = function
        mode, forced_name = _choice(tool_choice, by_name)
        return cls(functions, mode, forced_name, parallel_tool_calls, by_name)


def _function(tool: Any, index: int) -> Function:
    where = f"tools[{index}]"
    if not isinstance(tool, Mapping) or tool.get("type") != "function" or not isinstance(tool.get("function"), Mapping):
        raise InvalidRequestError(f"{where} must be {{'type': 'function', 'function': {{'name': ..., "
                                  f"'parameters': ...}}}}", param=where)
    function = tool["function"]
    name = function.get("name")
    if not isinstance(name, str) or not TOOL_NAME_PATTERN.match(name):
        raise InvalidRequestError(f"{where}.function.name must match ^[a-zA-Z0-9_-]{{1,64}}$, got {name!r}",
                                  param=f"{where}.function.name")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise InvalidRequestError(f"{where}.function.description must be a string", param=f"{where}.function.description")
    parameters = function.get("parameters")
    if parameters is None:
        parameters = NO_PARAMETERS_SCHEMA
    where_parameters = f"{where}.function.parameters"
    if not isinstance(parameters, Mapping):
        raise InvalidRequestError(f"{where_parameters} must be a JSON schema object, got "
                                  f"{type(parameters).__name__}", param=where_parameters)
    declared_type = parameters.get("type", "object")
    if declared_type != "object":
        # Arguments are a JSON object in every API that has tools; a call with a bare string or a
        # list would be unparseable by the client.
        raise InvalidRequestError(f"{where_parameters} must describe an object (type 'object'), got type "
                                  f"{declared_type!r}", param=where_parameters)
    return Function(name, description, closed_objects(parameters))


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "allOf", "oneOf", "prefixItems")
_SCHEMA_VALUES = ("items", "additionalProperties", "not", "contains", "if", "then", "else", "propertyNames")


def closed_objects(schema: Any) -> Any:
    """A copy of `schema` where every object schema that lists properties and says nothing about
    others gets additionalProperties false (walking the keywords that hold subschemas)."""
    if not isinstance(schema, Mapping):
        return schema
    closed = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(closed.get(key), Mapping):
            closed[key] = {name: closed_objects(value) for name, value in closed[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(closed.get(key), list):
            closed[key] = [closed_objects(value) for value in closed[key]]
    for key in _SCHEMA_VALUES:
        if key in closed:
            closed[key] = closed_objects(closed[key])
    if (isinstance(closed.get("properties"), Mapping) and "additionalProperties" not in closed
            and "patternProperties" not in closed and "unevaluatedProperties" not in closed):
        closed["additionalProperties"] = False
    return closed


def _choice(tool_choice: Any, by_name: Mapping[str, Function]) -> tuple[str, str | None]:
    if tool_choice is None:
        return "auto", None
    if isinstance(tool_choice, str):
        if tool_choice not in CHOICE_MODES:
            raise InvalidRequestError(f"tool_choice must be one of {list(CHOICE_MODES)} or {{'type': 'function', "
                                      f"'function': {{'name': ...}}}}, got {tool_choice!r}", param="tool_choice")
        return tool_choice, None
    if (not isinstance(tool_choice, Mapping) or tool_choice.get("type") != "function"
            or not isinstance(tool_choice.get("function"), Mapping)):
        raise InvalidRequestError("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', "
                                  "'function': {'name': ...}}", param="tool_choice")
    name = tool_choice["function"].get("name")
    if name not in by_name:
        raise InvalidRequestError(f"tool_choice names the function {name!r}, which is not among the tools "
                                  f"({sorted(by_name)})", param="tool_choice.function.name")
    return "function", name
