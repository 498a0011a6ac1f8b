"""Which tables are the toolkit's, for Alembic autogenerate: a host's and our own.

A host application's env.py passes `include_name` and `include_object` to
`context.configure(...)` so its autogenerate neither reflects nor compares the
outbox and receiver tables (nor our version table); our own env.py keeps the
opposite view, `only_ours`, built on the same rule.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from outbox.schema import index_on_backend

# Every table of the toolkit (its version table outbox_alembic_version included) has one of
# these prefixes, also the tables of a newer release this code does not declare yet.
TABLE_PREFIXES = ("outbox_", "receiver_")

IncludeObject = Callable[[Any, str | None, str, bool, Any], bool]

__all__ = ["TABLE_PREFIXES", "include_name", "include_object", "is_ours", "only_ours"]


def is_ours(table_name: str | None) -> bool:
    """Whether a table belongs to the outbox toolkit (its name starts with outbox_ or receiver_)."""
    return table_name is not None and table_name.startswith(TABLE_PREFIXES)


def include_name(name: str | None, type_: str, parent_names: Mapping[str, str | None]) -> bool:
    """A host's `include_name`: never reflect the toolkit's tables."""
    return not (type_ == "table" and is_ours(name))


def include_object(
    obj: Any, name: str | None, type_: str, reflected: bool, compare_to: Any
) -> bool:
    """A host's `include_object`: never compare the toolkit's tables, reflected or declared."""
    return not (type_ == "table" and is_ours(name))


def only_ours(dialect_name: str) -> tuple[Callable[..., bool], IncludeObject]:
    """Our env.py's (include_name, include_object): the toolkit's tables alone, each backend
    with the indexes its migrations build (PostgreSQL's own, the partial ones or their
    InnoDB counterparts: outbox.schema.index_on_backend)."""

    def name_filter(name: str | None, type_: str, parent_names: Mapping[str, str | None]) -> bool:
        return type_ != "table" or is_ours(name)

    def object_filter(
        obj: Any, name: str | None, type_: str, reflected: bool, compare_to: Any
    ) -> bool:
        if type_ == "index" and not index_on_backend(name, dialect_name):
            return False
        return type_ != "table" or is_ours(name)

    return name_filter, object_filter
