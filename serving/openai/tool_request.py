"""The tool fields of a chat request: ``tools``, ``tool_choice`` and ``parallel_tool_calls``.

``tools`` go to the model's chat template as given (Hugging Face passes the same list);
the template also decides how calls are written (``tool_calls.template_format``), and the
reply is parsed in that format. ``tool_choice``:

``"none"``        tools are rendered, the reply is text (not parsed for calls);
``"auto"``        the default with tools: the model may call, calls are parsed;
``"required"``    the reply is one or more calls (``parallel_tool_calls: false``: one);
``{"type": "function", "function": {"name": N}}``  the reply is one call of ``N``.

The last two are enforced by a grammar over the call format, with each function's
``parameters`` schema for its arguments (``tool_grammar``); so are the calls of ``"auto"``
when a function is ``strict``.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from .request_fields import FieldError, check_keys
from .tool_calls import ToolsUnsupported, template_format

TOOL_FIELDS = frozenset({"type", "function"})
FUNCTION_FIELDS = frozenset({"name", "description", "parameters", "strict"})
CHOICES = ("none", "auto", "required")
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names


@dataclass(frozen=True)
class ToolUse:
    """A chat request's tools and what it asks of them."""

    tools: tuple[dict, ...]  # as the template receives them
    choice: str  # "none" | "auto" | "required" | "function"
    function: Optional[str]  # the function tool_choice names
    parallel: bool
    format: Optional[str]  # tool_calls.HERMES or LLAMA3_JSON; None without tools

    @property
    def parses(self) -> bool:
        """Whether the reply is parsed for calls."""
        return self.format is not None and self.choice != "none"

    @property
    def enforced(self) -> bool:
        """Whether the reply must be calls (a grammar makes it so)."""
        return self.choice in ("required", "function")

    @property
    def strict(self) -> bool:
        """Whether calls the model chooses to make must validate (``auto`` with a strict function)."""
        return self.choice == "auto" and self.format is not None and any(
            t["function"].get("strict") for t in self.tools)

    @property
    def max_calls(self) -> Optional[int]:
        return None if self.parallel and self.choice != "function" else 1

    def schemas(self) -> dict[str, dict]:
        """Each callable function's name and its arguments' JSON schema."""
        functions = [t["function"] for t in self.tools]
        if self.function is not None:
            functions = [f for f in functions if f["name"] == self.function]
        return {f["name"]: f.get("parameters") or {"type": "object"} for f in functions}


def _tool(tool: Any, where: str) -> dict:
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise FieldError("tools", f"{where} must be {{'type': 'function', 'function': {{'name': ..., ...}}}}")
    check_keys(tool, TOOL_FIELDS, {}, where, "tools")
    function = tool["function"]
    check_keys(function, FUNCTION_FIELDS, {}, f"{where}.function", "tools")
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise FieldError("tools", f"{where}.function.name must be 1 to 64 letters, digits, '_' or '-'")
    if function.get("description") is not None and not isinstance(function["description"], str):
        raise FieldError("tools", f"{where}.function.description must be a string")
    parameters = function.get("parameters")
    if parameters is not None and (not isinstance(parameters, dict) or parameters.get("type", "object") != "object"):
        raise FieldError("tools", f"{where}.function.parameters must be a JSON Schema of an object (the arguments)")
    if function.get("strict") not in (None, True, False):
        raise FieldError("tools", f"{where}.function.strict must be true or false")
    return {"type": "function", "function": dict(function)}


def _choice(value: Any, names: set[str]) -> tuple[str, Optional[str]]:
    if value is None:
        return ("auto" if names else "none"), None
    if isinstance(value, str):
        if value not in CHOICES:
            raise FieldError("tool_choice", f"'tool_choice' must be one of {', '.join(CHOICES)} or "
                                       f"{{'type': 'function', 'function': {{'name': ...}}}}, got {value!r}")
        if value == "required" and not names:
            raise FieldError("tool_choice", "'tool_choice' 'required' needs 'tools' to call")
        return value, None
    function = value.get("function") if isinstance(value, dict) else None
    if (not isinstance(value, dict) or value.get("type") != "function" or set(value) != {"type", "function"}
            or not isinstance(function, dict) or set(function) != {"name"} or not isinstance(function["name"], str)):
        raise FieldError("tool_choice",
                         "'tool_choice' as an object must be {'type': 'function', 'function': {'name': ...}}")
    if function["name"] not in names:
        raise FieldError("tool_choice", f"'tool_choice' names the function {str(function['name'])[:80]!r}, "
                                   f"which is not among 'tools'")
    return "function", function["name"]


def parse_tool_use(body: Mapping[str, Any], template_source: Optional[str]) -> ToolUse:
    """The tool fields of a chat body, for a model whose chat template is ``template_source``.

    Raises:
        FieldError: a malformed field, or a template that cannot render tools.
    """
    raw = body.get("tools")
    if raw is not None and not isinstance(raw, list):
        raise FieldError("tools", "'tools' must be a list of function tools")
    tools = tuple(_tool(t, f"tools[{i}]") for i, t in enumerate(raw or ()))
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) < len(names):
        raise FieldError("tools", f"'tools' names a function twice: {sorted({n for n in names if names.count(n) > 1})}")
    choice, function = _choice(body.get("tool_choice"), set(names))
    parallel = body.get("parallel_tool_calls", True)
    if parallel is None:
        parallel = True
    if not isinstance(parallel, bool):
        raise FieldError("parallel_tool_calls", f"'parallel_tool_calls' must be true or false, got {parallel!r}")
    fmt = None
    if tools:
        try:
            fmt = template_format(template_source or "")
        except ToolsUnsupported as exc:
            raise FieldError("tools", str(exc)) from None
    return ToolUse(tools, choice, function, parallel, fmt)
