"""A Jinja sandbox with bounds, for templates that come inside model files.

Jinja's ``SandboxedEnvironment`` keeps a template from reaching Python's internals, not
from running long or building huge values: nested ``range`` loops, ``'x' * 10**10``,
``'%*s' % (10**9, '')``, a ``namespace`` value doubled in a loop, ``list.extend`` of
itself, ``center(10**9)`` or ``tojson(indent=10**9)`` each stop a worker or exhaust its
memory, and a model file is anyone's. Here:

- every value the template makes by an operator (``*``, ``**``, ``%``), a call (methods,
  globals) or a filter, and every value it stores in a ``namespace``, is at most
  ``MAX_ITEMS`` long (characters, items), checked before the operators that could build
  a big value build it and right after calls (whose work is then linear in what they
  were given);
- a width a filter pads to or indents by is at most ``MAX_WIDTH``;
- rendering stops past ``MAX_SECONDS`` (a trace function on the template's own frames
  looks at the clock every few hundred lines) and past ``MAX_OUTPUT`` characters.

Real chat templates stay far inside these bounds (the largest prompt ember accepts is
its context window); a template past them fails with ``ChatTemplateError``, which is a
refusal at load (the template's probe renders it) or a 400 at request time.
"""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Callable, Iterator, Sized
from contextlib import contextmanager
from typing import Any

from jinja2 import Template
from jinja2.sandbox import SandboxedEnvironment
from jinja2.utils import Namespace

from ember.errors import ChatTemplateError

MAX_ITEMS = 1 << 24  # characters of a string, items of a list, a value made by the template
MAX_WIDTH = 10_000  # what center/indent/wordwrap/truncate/format may pad to
MAX_OUTPUT = 1 << 25  # characters a rendering may produce
MAX_SECONDS = 2.0  # of one rendering
_CLOCK_EVERY = 256  # trace events between two looks at the clock

_TEMPLATE_FILE = "<template>"  # the filename Jinja compiles from_string sources under


class BoundedNamespace(Namespace):
    """``namespace()``: its values are bounded as any other the template makes."""

    def __setitem__(self, name: str, value: Any) -> None:
        _check_size(value, f"namespace value {name!r}")
        super().__setitem__(name, value)


class BoundedEnvironment(SandboxedEnvironment):
    intercepted_binops = frozenset({"*", "**", "%"})

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.globals["namespace"] = BoundedNamespace
        for name in ("center", "indent", "wordwrap"):
            self.filters[name] = _width_checked(self.filters[name], name)

    def call_binop(self, context: Any, op: str, left: Any, right: Any) -> Any:
        if op == "*":
            _check_repeat(left, right)
            _check_repeat(right, left)
        elif op == "**":
            _check_power(left, right)
        elif op == "%" and isinstance(left, str):
            _check_format(left, right)
        result = super().call_binop(context, op, left, right)
        _check_size(result, f"the result of {op!r}")
        return result

    def call(self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        for value in (*args, *kwargs.values()):
            if isinstance(value, int) and not isinstance(value, bool) \
                    and getattr(__obj, "__name__", "") in ("center", "ljust", "rjust",
                                                           "zfill", "expandtabs"):
                check_width(value, __obj.__name__)
        result = super().call(__context, __obj, *args, **kwargs)
        _check_size(result, f"the result of {getattr(__obj, '__name__', 'a call')}")
        owner = getattr(__obj, "__self__", None)  # list.extend, dict.update: grew it?
        if owner is not None and not isinstance(owner, type):
            _check_size(owner, f"the object {getattr(__obj, '__name__', '')} changed")
        return result


def render_bounded(template: Template, variables: dict[str, Any]) -> str:
    """``template`` rendered within the bounds above."""
    out: list[str] = []
    size = 0
    with _deadline(MAX_SECONDS):
        for chunk in template.generate(**variables):
            size += len(chunk)
            if size > MAX_OUTPUT:
                raise ChatTemplateError(f"the chat template wrote more than {MAX_OUTPUT} "
                                        "characters")
            out.append(chunk)
    return "".join(out)


@contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    """Trace the template's own frames (not the Python they call) and stop the
    rendering once ``seconds`` have passed."""
    end = time.monotonic() + seconds
    events = 0

    def local(frame: Any, event: str, arg: Any) -> Any:
        nonlocal events
        events += 1
        if events % _CLOCK_EVERY == 0 and time.monotonic() > end:
            raise ChatTemplateError(f"the chat template ran for more than {seconds:g} s")
        return local

    def calls(frame: Any, event: str, arg: Any) -> Any:
        return local if frame.f_code.co_filename == _TEMPLATE_FILE else None

    previous = sys.gettrace()
    sys.settrace(calls)
    try:
        yield
    finally:
        sys.settrace(previous)


def _size(value: Any) -> int:
    return len(value) if isinstance(value, Sized) and not isinstance(value, range) else 0


def _check_size(value: Any, what: str) -> None:
    if _size(value) > MAX_ITEMS:
        raise ChatTemplateError(f"the chat template made a value of more than {MAX_ITEMS} "
                                f"items ({what})")


def _check_repeat(seq: Any, times: Any) -> None:
    if isinstance(times, int) and _size(seq) * max(times, 0) > MAX_ITEMS:
        raise ChatTemplateError(f"the chat template repeats a value of {_size(seq)} items "
                                f"{times} times (at most {MAX_ITEMS} items)")


def _check_power(base: Any, exponent: Any) -> None:
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0 \
            and abs(base) > 1 and abs(base).bit_length() * exponent > 4096:
        raise ChatTemplateError(f"the chat template raises to a power too large "
                                f"({exponent})")


_FORMAT_SPEC = re.compile(r"%[-#0 +]*(\*|\d*)(?:\.(\*|\d*))?")


def _check_format(fmt: str, args: Any) -> None:
    """``%`` formatting: a width or precision written in the format, or taken from the
    arguments (``*``), at most MAX_WIDTH."""
    values = args if isinstance(args, tuple) else (args,)
    for spec in _FORMAT_SPEC.finditer(fmt):
        for part in spec.groups():
            if part == "*":
                for value in values:
                    if isinstance(value, int) and not isinstance(value, bool):
                        check_width(abs(value), "a % format")
            elif part:
                check_width(int(part), "a % format")


def check_width(width: Any, what: str) -> None:
    if isinstance(width, int) and width > MAX_WIDTH:
        raise ChatTemplateError(f"the chat template pads to a width of {width} ({what}; at "
                                f"most {MAX_WIDTH})")


def _width_checked(f: Callable[..., Any], name: str) -> Callable[..., Any]:
    def checked(*args: Any, **kwargs: Any) -> Any:
        for value in (*args[1:], *kwargs.values()):
            check_width(value if isinstance(value, int) and not isinstance(value, bool)
                         else 0, name)
        return f(*args, **kwargs)

    for attr in ("jinja_pass_arg",):  # keep how Jinja passes the environment / context
        if hasattr(f, attr):
            setattr(checked, attr, getattr(f, attr))
    return checked


__all__ = ["MAX_ITEMS", "MAX_OUTPUT", "MAX_SECONDS", "MAX_WIDTH", "BoundedEnvironment",
           "BoundedNamespace", "check_width", "render_bounded"]
