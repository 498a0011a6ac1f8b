"""Optional dependencies of the product that `make` installs (the `fast` extra)."""

from __future__ import annotations

import importlib
from types import ModuleType

import pytest

from support.environment import IN_CI


def require(name: str) -> ModuleType:
    """Import `name`; when it is missing, fail under CI=true (`make` installs it, so its
    tests must run there), skip elsewhere."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        if IN_CI:
            pytest.fail(f"{name} is required under CI=true and is not installed: {exc}")
        pytest.skip(f"{name} is not installed")
