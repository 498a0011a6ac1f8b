"""A batch's rows as a derived table: `SELECT ? AS a, ? AS b UNION ALL SELECT ?, ? ...`.

MySQL has no array parameters, and its JSON_TABLE reads a JSON null differently on
MySQL and MariaDB; a derived table of bound values reads the same on both, NULLs
included. PyMySQL binds on the client, so the text growing with the batch costs no
server-side plan.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any


def rows_table(names: Sequence[str], rows: Sequence[Sequence[Any]]) -> tuple[str, dict[str, Any]]:
    """The SQL of a derived table of `rows` (each the values of `names`, in order) and its
    parameters, named r<row>_<column>."""
    selects: list[str] = []
    params: dict[str, Any] = {}
    for i, row in enumerate(rows):
        fields = []
        for j, name in enumerate(names):
            params[f"r{i}_{j}"] = row[j]
            fields.append(f":r{i}_{j} AS {name}" if i == 0 else f":r{i}_{j}")
        selects.append("SELECT " + ", ".join(fields))
    return "(" + " UNION ALL ".join(selects) + ")", params


def qualified(set_clause: str, alias: str) -> str:
    """A shared SET clause with each assigned column named as `alias`'s: in an UPDATE joined
    to a derived table that has a column of the same name, a bare name is ambiguous."""
    return re.sub(r"(^|,)(\s*)(\w+) =", rf"\1\2{alias}.\3 =", set_clause, flags=re.MULTILINE)
