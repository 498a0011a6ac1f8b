"""The product's OUTBOX_ namespace holds only what the commands read.

The project's tests and benchmarks read their own settings under OUTBOXDEV_: a
development variable named OUTBOX_* would be refused by every command the
tests start (see outbox_cli.environment), or would have to be allowed there,
in the product. This reads every environment lookup in tests/ and benchmarks/
and fails on an OUTBOX_* name that the commands do not know.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from outbox_cli import known_variables
from outbox_cli.environment import PREFIX

ROOT = Path(__file__).resolve().parents[1]
DEVELOPMENT_PREFIX = "OUTBOXDEV_"


def constants(tree: ast.Module) -> dict[str, str]:
    """Module-level NAME = "string" assignments."""
    found: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            for target in node.targets:
                if isinstance(target, ast.Name) and isinstance(node.value.value, str):
                    found[target.id] = node.value.value
    return found


def is_environ(node: ast.expr) -> bool:
    """`os.environ` or a bare `environ`."""
    if isinstance(node, ast.Attribute):
        return node.attr == "environ"
    return isinstance(node, ast.Name) and node.id == "environ"


def looked_up(tree: ast.Module) -> Iterator[ast.expr]:
    """The key expression of each environment read: environ.get/[]/in, os.getenv."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args:
            func = node.func
            if isinstance(func, ast.Attribute) and (
                (func.attr in ("get", "pop") and is_environ(func.value)) or func.attr == "getenv"
            ):
                yield node.args[0]
        elif isinstance(node, ast.Subscript) and is_environ(node.value):
            yield node.slice
        elif isinstance(node, ast.Compare) and any(is_environ(c) for c in node.comparators):
            yield node.left


def read_names(path: Path) -> set[str]:
    """The variable names a file reads from the environment, where they are spelled out."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    named = constants(tree)
    names: set[str] = set()
    for key in looked_up(tree):
        if isinstance(key, ast.Constant) and isinstance(key.value, str):
            names.add(key.value)
        elif isinstance(key, ast.Name) and key.id in named:
            names.add(named[key.id])
    return names


def development_reads() -> dict[str, set[str]]:
    """Per file of tests/ and benchmarks/, the names it reads."""
    files = sorted((ROOT / "tests").rglob("*.py")) + sorted((ROOT / "benchmarks").rglob("*.py"))
    return {str(path.relative_to(ROOT)): read_names(path) for path in files}


def test_the_scan_finds_the_development_reads() -> None:
    every = set().union(*development_reads().values())
    # Read through a literal, and through a module constant: the scan sees both forms.
    assert {"OUTBOXDEV_TEST_PG_URL", "OUTBOXDEV_FAULTS_REPORT", "OUTBOXDEV_TEST_GATE"} <= every


def test_no_development_variable_is_in_the_products_namespace() -> None:
    known = known_variables()
    strays = {
        f"{path}: {name}"
        for path, names in development_reads().items()
        for name in names
        if name.startswith(PREFIX) and name not in known
    }
    assert not strays, f"read under {PREFIX} but no command reads it: {sorted(strays)}"
    assert not DEVELOPMENT_PREFIX.startswith(PREFIX)
