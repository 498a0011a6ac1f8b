"""The console's lists by state: replies (pending, sending, sent, dead, resolved) and tasks
(pending, running, and each final state), each in the order of the index that holds that
state (outbox.drivers.common.message_lists and task_lists), one destination's or
tenant's alone if asked, oldest or newest first, a page at a time from a keyset."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

from sqlalchemy.engine import Connection
from starlette.requests import Request
from starlette.responses import Response

from outbox.drivers import Driver
from outbox.drivers.common.task_lists import LIVE
from outbox.drivers.records import ListedPage, ListedTasks
from outbox.redaction import shown_value
from outbox.states import MessageState, TaskState
from outbox_cli.arguments import non_empty
from outbox_cli.console.filters import LARGEST_ID
from outbox_cli.console.pages import PAGE_SIZE, Pages

ORDERS = ("oldest", "newest")
LONGEST_TIEBREAK = 200
"""Characters of a task_id a page may start after (the column holds 64)."""

Page = ListedPage | ListedTasks


@dataclass(frozen=True)
class ListKind:
    """What one kind of list is: its states, its order, its filter, its reads."""

    template: str
    path: str
    states: tuple[str, ...]
    ordered_by: dict[str, str]
    """What each state's list is in the order of, in words."""
    newest_first: frozenset[str]
    """The states listed newest first unless asked otherwise: history read from its end."""
    narrowed_by: str
    """The query field that keeps one destination's or tenant's rows."""
    page: Callable[[str, str | None, bool, Any], Page]
    read: Callable[[Driver, Connection, Any], list[dict[str, Any]]]
    tiebreak: str
    """The row's field that breaks ties of the key."""
    numbered: bool
    """Whether the tiebreak is a number (a message id) or text (a task_id)."""


REPLIES = ListKind(
    template="replies.html",
    path="/replies",
    states=tuple(state.value for state in MessageState),
    ordered_by={
        "pending": "due",
        "sending": "lease ends",
        "sent": "sent",
        "dead": "created",
        "resolved": "created",
    },
    newest_first=frozenset({"sent", "resolved"}),
    narrowed_by="destination",
    page=ListedPage,
    read=lambda driver, conn, page: driver.messages_in_state(conn, page),
    tiebreak="id",
    numbered=True,
)
TASKS = ListKind(
    template="tasks.html",
    path="/tasks",
    states=tuple(state.value for state in TaskState),
    ordered_by={state.value: "created" if state in LIVE else "finished" for state in TaskState},
    newest_first=frozenset(state.value for state in TaskState if state not in LIVE),
    narrowed_by="tenant",
    page=ListedTasks,
    read=lambda driver, conn, page: driver.tasks_in_state(conn, page),
    tiebreak="task_id",
    numbered=False,
)


class Lists:
    """GET /replies or /tasks: one page of the rows in a state."""

    def __init__(self, pages: Pages, kind: ListKind) -> None:
        """Read and render `kind` through `pages`."""
        self.pages = pages
        self.kind = kind

    def page(self, request: Request) -> Response:
        """The page the query asks for (state, narrowing, order, after); 400 for a bad one."""
        params = request.query_params
        kind = self.kind
        try:
            listed = listed_page(
                kind,
                params.get("state", "pending"),
                params.get(kind.narrowed_by, ""),
                params.get("order", ""),
                params.get("after", ""),
            )
        except ValueError as exc:
            return self._render(request, 400, None, [], None, error=str(exc))
        ops = self.pages.ops
        with ops.engine.connect() as conn:
            rows = kind.read(ops.driver, conn, listed._replace(limit=PAGE_SIZE + 1))
        more = None
        if len(rows) > PAGE_SIZE:
            rows = rows[:PAGE_SIZE]
            last = rows[-1]
            place = f"{last['listed_key']!r},{last[kind.tiebreak]}"
            more = urlencode({**kept(kind, listed), "after": place})
        return self._render(request, 200, listed, rows, more, error=None)

    def _render(
        self,
        request: Request,
        status: int,
        listed: Page | None,
        rows: list[dict[str, Any]],
        more: str | None,
        *,
        error: str | None,
    ) -> Response:
        """The list's page."""
        kind = self.kind
        state = listed.state if listed is not None else None
        narrowed = None if listed is None else narrowing(listed)
        return self.pages.render(
            request,
            kind.template,
            status,
            list_path=kind.path,
            narrowed_by=kind.narrowed_by,
            listed=listed,
            state=state,
            narrowed=narrowed,
            states=kind.states,
            ordered_by=kind.ordered_by.get(state or "", ""),
            rows=rows,
            more=more,
            first=None if listed is None or listed.after is None else urlencode(kept(kind, listed)),
            error=error,
        )


def kept(kind: ListKind, listed: Page) -> dict[str, str]:
    """The query that asks for `listed` again from its first page."""
    query = {"state": listed.state, "order": "newest" if listed.newest else "oldest"}
    if (narrowed := narrowing(listed)) is not None:
        query[kind.narrowed_by] = narrowed
    return query


def narrowing(listed: Page) -> str | None:
    """The destination or tenant a list keeps alone, or None."""
    return listed.destination if isinstance(listed, ListedPage) else listed.tenant


def listed_page(kind: ListKind, state: str, narrowed: str, order: str, after: str) -> Page:
    """The page a query names; ValueError names what is wrong with it."""
    if state not in kind.states:
        raise ValueError(f"state must be one of {', '.join(kind.states)}: {shown_value(state)}")
    if order and order not in ORDERS:
        raise ValueError(f"order must be oldest or newest: {shown_value(order)}")
    newest = order == "newest" if order else state in kind.newest_first
    chosen = non_empty(narrowed) if narrowed.strip() else None
    return kind.page(state, chosen, newest, page_after(after, kind.numbered))


def page_after(given: str, numbered: bool) -> tuple[float, Any] | None:
    """The (key, tiebreak) a page starts after, as "key,tiebreak" (None: the first page): a
    message id when `numbered`, else a task_id; ValueError if it is not one."""
    if not given.strip():
        return None
    key_text, _, tiebreak = given.partition(",")
    try:
        key = float(key_text)
    except ValueError:
        key = math.nan
    if numbered:
        try:
            number = int(tiebreak)
        except ValueError:
            number = -1
        if math.isfinite(key) and 0 <= number <= LARGEST_ID:
            return key, number
    elif math.isfinite(key) and 0 < len(tiebreak) <= LONGEST_TIEBREAK:
        return key, tiebreak
    raise ValueError(f"after: not a place in the list: {shown_value(given)}")
