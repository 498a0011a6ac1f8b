"""Keyset pages: a list walked in (key, tiebreak) order, each page starting after the pair
the previous one ended on, never by OFFSET, so a page deep in a long history costs what
the first does."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa


def keyset_page(
    query: sa.Select[Any],
    key: sa.ColumnElement[Any],
    tiebreak: sa.ColumnElement[Any],
    *,
    newest: bool,
    after: tuple[Any, Any] | None,
    limit: int,
) -> sa.Select[Any]:
    """`query` ordered by (key, tiebreak), descending if `newest`, from after the pair
    `after` (None: the first page), `limit` rows. When the key is the tiebreak itself, it
    alone orders the page."""
    alone = key is tiebreak
    if after is not None:
        after_key, after_tiebreak = after
        if alone:
            query = query.where(tiebreak < after_tiebreak if newest else tiebreak > after_tiebreak)
        elif newest:
            # The range's bound alone as well: the index walk starts there, not at its end.
            query = query.where(
                key <= after_key, sa.or_(key < after_key, tiebreak < after_tiebreak)
            )
        else:
            query = query.where(
                key >= after_key, sa.or_(key > after_key, tiebreak > after_tiebreak)
            )
    columns = [key] if alone else [key, tiebreak]
    order = [column.desc() if newest else column for column in columns]
    return query.order_by(*order).limit(limit)
