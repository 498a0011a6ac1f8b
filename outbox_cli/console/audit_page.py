"""The console's audit page: every decision about dead messages (requeue, resolve), newest
first, by any operator or one, paged by id."""

from __future__ import annotations

from urllib.parse import urlencode

from starlette.requests import Request
from starlette.responses import Response

from outbox.redaction import shown_value
from outbox_cli.console.filters import LARGEST_ID
from outbox_cli.console.pages import PAGE_SIZE, Pages


class AuditPage:
    """GET /audit: the decisions, newest first; `by` keeps one operator's, `before` pages."""

    def __init__(self, pages: Pages) -> None:
        """Read and render through `pages`."""
        self.pages = pages

    def page(self, request: Request) -> Response:
        """The page of decisions the query asks for; 400 for a bad `before`."""
        params = request.query_params
        by = params.get("by", "").strip() or None
        given = params.get("before", "").strip()
        try:
            before = audit_start(given)
        except ValueError as exc:
            return self.pages.render(
                request, "audit.html", 400, rows=[], by=by, error=str(exc), older=None
            )
        ops = self.pages.ops
        with ops.engine.connect() as conn:
            rows = ops.driver.audit_page(conn, PAGE_SIZE + 1, before, by)
        older = None
        if len(rows) > PAGE_SIZE:
            rows = rows[:PAGE_SIZE]
            kept = {"by": by} if by else {}
            older = urlencode({**kept, "before": rows[-1]["id"]})
        return self.pages.render(request, "audit.html", rows=rows, by=by, error=None, older=older)


def audit_start(given: str) -> int | None:
    """The decision id a page starts before (None: the newest); ValueError if not one."""
    if not given:
        return None
    try:
        start = int(given)
    except ValueError:
        start = -1
    if not 0 < start <= LARGEST_ID:
        raise ValueError(f"before: not a decision id: {shown_value(given)}")
    return start
