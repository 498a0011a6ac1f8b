"""The console's lists of replies by state: pending, sending, sent, dead, resolved, each in
the order of the index that holds that state (outbox.drivers.common.message_lists), a
destination's alone if asked, oldest or newest first, a page at a time from a keyset."""

from __future__ import annotations

import math
from typing import Any
from urllib.parse import urlencode

from starlette.requests import Request
from starlette.responses import Response

from outbox.drivers.records import ListedPage
from outbox.redaction import shown_value
from outbox.states import MessageState
from outbox_cli.arguments import non_empty
from outbox_cli.console.filters import LARGEST_ID
from outbox_cli.console.pages import PAGE_SIZE, Pages

STATES = tuple(state.value for state in MessageState)
ORDERED_BY = {
    "pending": "due",
    "sending": "lease ends",
    "sent": "sent",
    "dead": "created",
    "resolved": "created",
}
"""What each state's list is in the order of, in words (the column LISTED_BY names)."""
NEWEST_FIRST = frozenset({"sent", "resolved"})
"""The states listed newest first unless asked otherwise: history is read from its end."""
ORDERS = ("oldest", "newest")


class ReplyLists:
    """GET /replies: one page of the replies in a state."""

    def __init__(self, pages: Pages) -> None:
        """Read and render through `pages`."""
        self.pages = pages

    def page(self, request: Request) -> Response:
        """The page the query asks for (state, destination, order, after); 400 for a bad one."""
        params = request.query_params
        try:
            listed = listed_page(
                params.get("state", "pending"),
                params.get("destination", ""),
                params.get("order", ""),
                params.get("after", ""),
            )
        except ValueError as exc:
            return self._render(request, 400, None, [], None, error=str(exc))
        ops = self.pages.ops
        with ops.engine.connect() as conn:
            rows = ops.driver.messages_in_state(conn, listed._replace(limit=PAGE_SIZE + 1))
        more = None
        if len(rows) > PAGE_SIZE:
            rows = rows[:PAGE_SIZE]
            last = rows[-1]
            more = urlencode({**kept(listed), "after": f"{last['listed_key']!r},{last['id']}"})
        return self._render(request, 200, listed, rows, more, error=None)

    def _render(
        self,
        request: Request,
        status: int,
        listed: ListedPage | None,
        rows: list[dict[str, Any]],
        more: str | None,
        *,
        error: str | None,
    ) -> Response:
        """The list's page."""
        state = listed.state if listed is not None else None
        return self.pages.render(
            request,
            "replies.html",
            status,
            listed=listed,
            state=state,
            states=STATES,
            ordered_by=ORDERED_BY.get(state or "", ""),
            rows=rows,
            more=more,
            first=None if listed is None or listed.after is None else urlencode(kept(listed)),
            error=error,
        )


def kept(listed: ListedPage) -> dict[str, str]:
    """The query that asks for `listed` again from its first page."""
    query = {"state": listed.state, "order": "newest" if listed.newest else "oldest"}
    if listed.destination is not None:
        query["destination"] = listed.destination
    return query


def listed_page(state: str, destination: str, order: str, after: str) -> ListedPage:
    """The page a query names; ValueError names what is wrong with it."""
    if state not in STATES:
        raise ValueError(f"state must be one of {', '.join(STATES)}: {shown_value(state)}")
    if order and order not in ORDERS:
        raise ValueError(f"order must be oldest or newest: {shown_value(order)}")
    newest = order == "newest" if order else state in NEWEST_FIRST
    chosen = non_empty(destination) if destination.strip() else None
    return ListedPage(state, chosen, newest, page_after(after))


def page_after(given: str) -> tuple[float, int] | None:
    """The (key, id) a page starts after, as "key,id" (None: the first page); ValueError if
    it is not one."""
    if not given.strip():
        return None
    key_text, _, id_text = given.partition(",")
    try:
        key, message_id = float(key_text), int(id_text)
    except ValueError:
        key, message_id = math.nan, -1
    if not math.isfinite(key) or not 0 <= message_id <= LARGEST_ID:
        raise ValueError(f"after: not a place in the list: {shown_value(given)}")
    return key, message_id
