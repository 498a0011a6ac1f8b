"""What kind of handler the worker was given: a plain function, an `async def`, or neither.

Decided once, at start: a handler of the wrong kind would otherwise be found out by
every task it fails (a coroutine or a generator is not a result).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any


class WrongHandlerKind(TypeError):
    """The handler is neither a plain function returning its result nor an `async def`."""


def handler_name(handler: object) -> str:
    """`module:qualname` of a handler, for logs and errors."""
    target = handler.func if isinstance(handler, functools.partial) else handler
    module = getattr(target, "__module__", None) or "?"
    qualname = getattr(target, "__qualname__", None) or type(target).__qualname__
    return f"{module}:{qualname}"


def is_async_handler(handler: object) -> bool:
    """True for an `async def` handler, False for a plain one; WrongHandlerKind otherwise."""
    name = handler_name(handler)
    if not callable(handler):
        raise WrongHandlerKind(f"handler {name} is not callable")
    if inspect.isclass(handler):
        raise WrongHandlerKind(
            f"handler {name} is a class: calling it makes an instance, not a result; "
            "pass a function (or an instance with __call__)"
        )
    call = _code_of(handler)
    if inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(call):
        return True
    if inspect.isasyncgenfunction(call) or inspect.isgeneratorfunction(call):
        raise WrongHandlerKind(
            f"handler {name} is a generator function: it yields, and a handler must return "
            "its result (or be declared `async def`)"
        )
    if inspect.iscoroutinefunction(_code_of(inspect.unwrap(call))):
        # A decorator's plain wrapper around an `async def`: every call returns a coroutine.
        raise WrongHandlerKind(
            f"handler {name} is a plain function wrapping an `async def` (it returns a "
            "coroutine): declare the wrapper `async def` and await the wrapped function"
        )
    return False


def _code_of(handler: Any) -> Any:
    """The function that runs when `handler` is called (partials and instances resolved)."""
    while isinstance(handler, functools.partial):
        handler = handler.func
    if inspect.isfunction(handler) or inspect.ismethod(handler) or inspect.isbuiltin(handler):
        return handler
    # An instance: what runs is its class's __call__ (callable() was checked first).
    return type(handler).__call__
