"""The pieces of SQL a backend supplies, and what the portable statements build from them."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any

import sqlalchemy as sa
from sqlalchemy.sql.elements import ColumnElement

from outbox.drivers.base import Now


class DriverPieces(ABC):
    """What differs between backends in the portable statements: a subclass names it."""

    name: str
    supports_skip_locked: bool

    @abstractmethod
    def database_now(self) -> ColumnElement[float]:
        """SQL for the database's current time in epoch seconds."""

    @abstractmethod
    def dialect_insert(self, table: sa.Table) -> Any:
        """The backend's own INSERT construct, which knows ON CONFLICT."""

    @abstractmethod
    def in_names(self, column: ColumnElement[str], name: str) -> Any:
        """`column` is one of the names bound to parameter `name` (a list)."""

    @abstractmethod
    def not_in_names(self, column: ColumnElement[str], name: str) -> Any:
        """`column` is none of the names bound to parameter `name` (a list)."""

    @abstractmethod
    def floor(self, value: ColumnElement[Any]) -> ColumnElement[int]:
        """The whole number at or below a positive `value`."""

    def now_sql(self, now: Now) -> ColumnElement[float]:
        """The "now" to put in a statement: `now` written in, or the database clock."""
        if now is None:
            return self.database_now()
        return sa.literal(float(now), sa.Double())

    def bound_now(self) -> ColumnElement[float]:
        """The "now" of a statement built once: bind `now` to a manual time, or None."""
        # Read in the statement either way: no extra round trip for the database's clock.
        return sa.func.coalesce(sa.bindparam("now", type_=sa.Double()), self.database_now())

    def insert_ignoring_conflicts(self, table: sa.Table) -> Any:
        """INSERT that skips a row whose unique key already exists (the caller then compares)."""
        return self.dialect_insert(table).on_conflict_do_nothing()

    def upsert(
        self,
        table: sa.Table,
        keys: list[str],
        update: list[str],
        kept: Mapping[str, str] | None = None,
    ) -> Any:
        """INSERT that, where the row with these `keys` exists, sets its `update` columns; a
        column of `kept` keeps its stored value when the new row's column it names is NULL."""
        statement = self.dialect_insert(table)
        values = upserted(table, update, kept or {}, statement.excluded)
        return statement.on_conflict_do_update(index_elements=keys, set_=values)


def upserted(
    table: sa.Table, update: list[str], kept: Mapping[str, str], new: Any
) -> dict[str, Any]:
    """An upsert's SET: each `update` column from the `new` row (ON CONFLICT's `excluded`,
    MySQL's `inserted`), or, for a column of `kept`, the stored value where the new row's
    column that `kept` names is NULL."""
    values: dict[str, Any] = {}
    for name in update:
        given = kept.get(name)
        values[name] = (
            new[name]
            if given is None
            else sa.case((new[given].is_(None), table.c[name]), else_=new[name])
        )
    return values
