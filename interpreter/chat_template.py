"""Chat templates from model files, compiled once and rendered in Jinja's immutable sandbox.

A template is code from a downloaded file, so it gets what Hugging Face's own renderer
gives templates (the helpers ``raise_exception`` and ``strftime_now``, a ``tojson``
filter with json.dumps' options, ``{% break %}``/``{% continue %}``, the ``{% generation %}``
marker tag, trim_blocks and lstrip_blocks) and nothing more: no attribute starting with
``_``, no mutation of lists or dicts, ranges of at most 100,000 items, and no value
(string, list, integer) grown past ``MAX_TEXT`` characters or ``MAX_INT_BITS`` bits by an
operator, a padding method or filter, or a format width. A render also runs within a
time budget (``DEFAULT_BUDGET`` seconds of its thread's CPU time, per render): every loop
iteration and every call counts, so nested loops and runaway recursion stop at the budget,
and calls nest at most ``MAX_CALL_DEPTH`` deep. Any failure is one ``ChatTemplateError``.
"""
from __future__ import annotations

import json
import re
import time
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import Any, Mapping, Optional, Sequence

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.compiler import CodeGenerator
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError
from jinja2.utils import Namespace

from .template_budget import DEFAULT_BUDGET

# Far above any prompt a model's context holds; bounds what one template step may allocate.
MAX_TEXT = 4_000_000
MAX_INT_BITS = 1 << 16
# Calls nested this deep are runaway recursion (real templates nest a few macros); Python's
# own recursion limit would stop a macro at ~160 levels, with a less useful message.
MAX_CALL_DEPTH = 64
# The CPU clock is read every this many counted steps (a step costs ~1 us, the clock ~0.5 us).
_CLOCK_EVERY = 64
# A printf or str.format field whose width or precision has 7+ digits pads past any real prompt.
_WIDE_FIELD = re.compile(r"%[-+ #0]*(\d{7,}|\d*\.\d{7,})|\{[^{}]*:[^{}]*\d{7,}[^{}]*\}")


class ChatTemplateError(ValueError, jinja2.TemplateError):
    """A chat template that does not compile, refuses the messages (``raise_exception``), or
    breaks a sandbox rule; the message says which. (Also a ``jinja2.TemplateError``, so code
    that caught Jinja's errors keeps working.)"""


def _refuse(what: str) -> None:
    raise SecurityError(f"the chat template tried to {what}")


class _OverBudget(Exception):
    """A render ran past its budget (not a TemplateError, so nothing in Jinja handles it)."""


@dataclass
class _Budget:
    """One render's spending: counted steps, call depth, and its thread's CPU-time deadline."""

    seconds: float
    deadline: float
    steps: int = 0
    depth: int = 0

    def step(self) -> None:
        self.steps += 1
        if self.steps % _CLOCK_EVERY == 0 and time.thread_time() > self.deadline:
            raise _OverBudget(
                f"the model's chat template ran past its budget of {self.seconds:g} s of CPU time "
                f"({self.steps:,} loop iterations and calls) and was stopped; a template that needs "
                "longer is not a chat template (serve/run --template-budget SECONDS raises the budget)"
            )


# The budget of the render running in this thread (renders run on worker threads).
_BUDGET: ContextVar[Optional[_Budget]] = ContextVar("chat_template_budget", default=None)


def _loop_step() -> bool:
    """Called once per loop iteration; the sandbox counts the call (True, so it can guard a
    loop filter's test)."""
    return True


def _check_size(value: Any) -> Any:
    if isinstance(value, (str, list, tuple)) and len(value) > MAX_TEXT:
        _refuse(f"build a value of {len(value):,} items (the limit is {MAX_TEXT:,})")
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > MAX_INT_BITS:
        _refuse(f"build an integer of {value.bit_length():,} bits")
    return value


def _check_widths(args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    """Refuse a width or count argument that would pad a value past the limit."""
    for arg in (*args, *kwargs.values()):
        if isinstance(arg, int) and not isinstance(arg, bool) and abs(arg) > MAX_TEXT:
            _refuse(f"pad or repeat a value {arg:,} times")


def _check_format(spec: str, values: Any) -> None:
    """Refuse a format string whose field widths (given, or ``*`` taken from ``values``) are too wide."""
    if _WIDE_FIELD.search(spec):
        _refuse("format a field wider than the limit")
    if "*" in spec:
        _check_widths(values if isinstance(values, (tuple, list)) else (values,), {})


def _size_of(value: Any) -> int:
    if isinstance(value, (str, list, tuple)):
        return len(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return abs(value)
    return 0


class _Sandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            sizes = (_size_of(left), _size_of(right))
            if isinstance(left, int) and isinstance(right, int):
                if left.bit_length() + right.bit_length() > MAX_INT_BITS:
                    _refuse("multiply integers past the limit")
            elif sizes[0] * sizes[1] > MAX_TEXT:
                _refuse(f"repeat a value to {sizes[0] * sizes[1]:,} items")
        elif operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1:
            if right * left.bit_length() > MAX_INT_BITS:
                _refuse("raise an integer past the limit")
        elif operator == "%" and isinstance(left, str):
            _check_format(left, right)
        return _check_size(super().call_binop(context, operator, left, right))

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (Jinja's signature)
        method = getattr(__obj, "__wrapped__", __obj)  # the sandbox wraps str.format
        owner = getattr(method, "__self__", None)
        if isinstance(owner, str):
            if getattr(method, "__name__", "") in ("format", "format_map"):
                _check_format(owner, ())
            else:
                _check_widths(args, kwargs)
        budget = _BUDGET.get()
        if budget is None:
            return _check_size(super().call(__context, __obj, *args, **kwargs))
        # Every call (macros, recursive loop(), methods, globals) is a step; nesting is counted.
        budget.step()
        if budget.depth >= MAX_CALL_DEPTH:
            raise _OverBudget(f"the model's chat template nested calls {MAX_CALL_DEPTH} deep (runaway "
                              "recursion) and was stopped")
        budget.depth += 1
        try:
            return _check_size(super().call(__context, __obj, *args, **kwargs))
        finally:
            budget.depth -= 1


class _BoundedCodeGenerator(CodeGenerator):
    """Routes ``~`` (string concatenation) through a size check, as the sandbox does binops,
    and makes every loop iteration (and every loop filter test) a call, which the sandbox
    counts against the render budget: even a loop that calls and prints nothing is counted."""

    def visit_Concat(self, node: jinja2.nodes.Concat, frame: Any) -> None:
        self.write("environment.checked_size(")
        super().visit_Concat(node, frame)
        self.write(")")

    def visit_For(self, node: jinja2.nodes.For, frame: Any) -> None:
        # A call is never constant, so Jinja cannot fold it out of a constant filter test.
        def step() -> jinja2.nodes.Call:
            return jinja2.nodes.Call(jinja2.nodes.EnvironmentAttribute("budget_step"), [], [], None, None,
                                     lineno=node.lineno)

        node.body = [jinja2.nodes.ExprStmt(step(), lineno=node.lineno), *node.body]
        if node.test is not None:
            node.test = jinja2.nodes.And(step(), node.test, lineno=node.lineno)
        super().visit_For(node, frame)


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (HF's assistant-mask marker): renders its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


class _TemplateNamespace(Namespace):
    """``namespace(...)`` that refuses ``_``-prefixed names (which could shadow internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 (Namespace's signature trick)
        self, attrs = args[0], dict(*args[1:], **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            _refuse(f"store the private name {name!r} on a namespace")


def _template_dict(*args: Any, **kwargs: Any) -> dict:
    """``dict(...)`` for templates: builds a dict, without exposing the ``dict`` type itself."""
    return dict(*args, **kwargs)


def _raise_exception(message: Any) -> None:
    raise jinja2.TemplateError(str(message))


def _tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # HF's filter: json.dumps with its options, no HTML escaping (Jinja's own tojson escapes).
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _bounded_filters(filters: dict) -> None:
    """Bound the filters that pad: ``center``/``indent`` widths and ``format``'s field widths."""
    center, indent, format_ = filters["center"], filters["indent"], filters["format"]

    def bounded_center(value: Any, width: int = 80) -> str:
        _check_widths((width,), {})
        return center(value, width)

    def bounded_indent(value: Any, width: Any = 4, *args: Any, **kwargs: Any) -> str:
        pad = width if isinstance(width, int) and not isinstance(width, bool) else len(str(width))
        _check_widths((pad * (str(value).count("\n") + 1),), {})
        return _check_size(indent(value, width, *args, **kwargs))

    def bounded_format(value: Any, *args: Any, **kwargs: Any) -> str:
        _check_format(str(value), args)
        return _check_size(format_(value, *args, **kwargs))

    filters.update(center=bounded_center, indent=bounded_indent, format=bounded_format)


def _environment() -> _Sandbox:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationTag])
    env.code_generator_class = _BoundedCodeGenerator
    env.checked_size = _check_size
    env.budget_step = _loop_step
    _bounded_filters(env.filters)
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_template_dict,
                       namespace=_TemplateNamespace)
    return env


_ENV = _environment()


class ChatTemplate:
    """A compiled chat template.

    Raises:
        ChatTemplateError: the source does not compile (the message gives the line).
    """

    def __init__(self, source: str) -> None:
        self.source = source
        self._template = _compile(source)

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, *,
               budget: float = DEFAULT_BUDGET, **variables: Any) -> str:
        """The prompt text, with the variables HF passes (``tools``/``documents`` None, special tokens).

        ``budget``: the CPU seconds this render may take (of the calling thread, so other
        threads, such as a server's other requests, run meanwhile).

        Raises:
            ChatTemplateError: the template failed, refused these messages, or ran past the budget.
        """
        context = {"tools": None, "documents": None, **variables}
        token = _BUDGET.set(_Budget(budget, time.thread_time() + budget))
        try:
            text = self._template.render(messages=[dict(m) for m in messages],
                                         add_generation_prompt=add_generation_prompt, **context)
            return _check_size(text)
        except _OverBudget as exc:
            raise ChatTemplateError(str(exc)) from None
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the model's chat template failed: {exc}") from None
        except Exception as exc:  # the template is foreign code: any failure is its failure
            raise ChatTemplateError(f"the model's chat template failed: {type(exc).__name__}: {exc}") from None
        finally:
            _BUDGET.reset(token)


@lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    try:
        return _ENV.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(
            f"the model's chat template does not compile: {exc.message} (line {exc.lineno})"
        ) from None
    except Exception as exc:
        raise ChatTemplateError(f"the model's chat template does not compile: {type(exc).__name__}: {exc}") from None
