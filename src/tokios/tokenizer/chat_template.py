"""Chat template rendering: a model's jinja2 template in a sandbox, as transformers renders it.

Owns message validation and `ChatTemplate.render`; used by Tokenizer.apply_chat_template (the
server and the chat command call that). The environment matches transformers'
apply_chat_template: ImmutableSandboxedEnvironment with trim_blocks and lstrip_blocks, the
loopcontrols extension, a `{% generation %}` block, `raise_exception`, `strftime_now`, a
non-HTML-escaping `tojson`, and namespaces that refuse underscore attributes. Templates come
from model files, so they are treated as untrusted code.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tokios.errors import InvalidRequestError, ModelLoadError


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False):
    # Jinja's own tojson escapes <, >, & and ' for HTML, which would change the prompt.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(date_format: str) -> str:
    return datetime.now().strftime(date_format)


class _TemplateNamespace(jinja2.utils.Namespace):
    """A jinja namespace that refuses underscore names, so templates cannot reach internals."""

    def __init__(*args: Any, **kwargs: Any):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore attributes ({name!r})")


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; here it
    only renders its body, so templates that use it still compile."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return caller()


def _new_environment() -> ImmutableSandboxedEnvironment:
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    environment.globals["namespace"] = _TemplateNamespace
    return environment


def _plain(value: Any) -> Any:
    """A copy made only of JSON types, so the sandbox never sees caller objects' methods."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(key): _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    raise InvalidRequestError(f"unsupported value of type {type(value).__name__} in chat input", param="messages")


def _flatten_content(content: Any, index: int) -> Any:
    """OpenAI content parts -> one string, for templates that concatenate `message['content']`.

    Only text parts are accepted (this engine serves text models); parts are joined with newlines
    as vLLM does for string-format templates.
    """
    if not isinstance(content, list):
        return content
    texts = []
    for part in content:
        if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise InvalidRequestError(
                f"messages[{index}].content: only text parts ({{'type': 'text', 'text': ...}}) are supported",
                param="messages",
            )
        texts.append(part["text"])
    return "\n".join(texts)


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Check that `messages` is a non-empty list of {role: str, content: str | text parts | None}."""
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
        raise InvalidRequestError("messages must be a list of {role, content} objects", param="messages")
    if len(messages) == 0:
        raise InvalidRequestError("messages must contain at least one message", param="messages")
    validated = []
    for index, message in enumerate(messages):
        message = _plain(message)
        if not isinstance(message, dict):
            raise InvalidRequestError(
                f"messages[{index}] must be an object with 'role' and 'content', got {type(message).__name__}",
                param="messages",
            )
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise InvalidRequestError(f"messages[{index}].role must be a non-empty string", param="messages")
        if "content" not in message and "tool_calls" not in message:
            raise InvalidRequestError(f"messages[{index}] has no 'content'", param="messages")
        content = message.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise InvalidRequestError(
                f"messages[{index}].content must be a string or a list of text parts", param="messages"
            )
        message["content"] = _flatten_content(content, index)
        validated.append(message)
    return validated


class ChatTemplate:
    """A compiled chat template; render() is safe to call from many threads."""

    def __init__(self, source: str):
        self.source = source
        environment = _new_environment()
        try:
            self._template = environment.from_string(source)
            # Templates written for tool calling read the `tools` variable; the others get our
            # prompt format for tools (tool_calls/prompt.py).
            self.variables = frozenset(jinja2.meta.find_undeclared_variables(environment.parse(source)))
            self.takes_tools = "tools" in self.variables
        except jinja2.exceptions.TemplateError as exc:
            raise ModelLoadError(f"the model's chat template does not compile: {exc}") from None
        self.takes_object_arguments = self.takes_tools and self._writes_string_arguments_quoted()

    def _writes_string_arguments_quoted(self) -> bool:
        """Whether the template writes a past call's arguments with `tojson` whatever they are
        (gpt-oss's): OpenAI clients send them as a JSON string, which it would write as a quoted
        string, not the object the model wrote. Found by rendering a probe conversation once, as
        llama.cpp probes its templates."""
        call = {"id": "call_probe", "type": "function", "function": {"name": "probe", "arguments": '{"probe": 1}'}}
        probe = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [call]},
                 {"role": "tool", "tool_call_id": "call_probe", "content": "y"}]
        tool = {"type": "function", "function": {"name": "probe", "description": "", "parameters": {
            "type": "object", "properties": {"probe": {"type": "integer"}}}}}
        try:
            rendered = self._template.render(messages=probe, tools=[tool], add_generation_prompt=True)
        except Exception:  # noqa: BLE001 - a template that cannot render the probe takes what it is given
            return False
        return '\\"probe\\"' in rendered

    def render(
        self,
        messages: Any,
        *,
        add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None,
        special_tokens: Mapping[str, str],
        **kwargs: Any,
    ) -> str:
        validated = validate_messages(messages)
        if self.takes_object_arguments:
            validated = [_with_object_arguments(message) for message in validated]
        # Caller kwargs may set extra variables (documents, enable_thinking, ...) but never the
        # conversation itself.
        variables = {
            "documents": None,
            **special_tokens,
            **_plain(kwargs),
            "messages": validated,
            "tools": _plain(tools),
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            return self._template.render(**variables)
        except jinja2.exceptions.TemplateError as exc:
            # raise_exception() in a template is how templates reject a conversation shape.
            raise InvalidRequestError(f"chat template rejected the messages: {exc}", param="messages") from None
        except (TypeError, KeyError, AttributeError) as exc:
            raise InvalidRequestError(
                f"chat template cannot render these messages: {type(exc).__name__}: {exc}", param="messages"
            ) from None


def _with_object_arguments(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant turn whose calls' arguments are JSON text, with them as objects."""
    calls = message.get("tool_calls")
    if not isinstance(calls, list):
        return message
    converted = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        arguments = function.get("arguments") if isinstance(function, dict) else None
        if isinstance(arguments, str):
            try:
                parsed = json.loads(arguments)
            except json.JSONDecodeError:
                parsed = None
            if isinstance(parsed, dict):
                call = {**call, "function": {**function, "arguments": parsed}}
        converted.append(call)
    return {**message, "tool_calls": converted}


BUILTIN_TEMPLATE_NAMES = ("chatml", "gemma")


def resolve_chat_template(value: str) -> str:
    """--chat-template: a built-in name (chatml, gemma) or the path of a Jinja file -> its source,
    checked to compile (an error names the file and the problem)."""
    from importlib.resources import files
    from pathlib import Path

    if value in BUILTIN_TEMPLATE_NAMES:
        source = files("tokios.tokenizer").joinpath("templates", f"{value}.jinja").read_text(encoding="utf-8")
    else:
        path = Path(value)
        if not path.is_file():
            raise InvalidRequestError(
                f"chat_template {value!r} is neither a built-in template ({', '.join(BUILTIN_TEMPLATE_NAMES)}) "
                "nor a readable file", param="chat_template")
        source = path.read_text(encoding="utf-8")
    try:
        ChatTemplate(source)
    except ModelLoadError as exc:
        raise InvalidRequestError(f"chat_template {value!r}: {exc}", param="chat_template") from None
    return source
