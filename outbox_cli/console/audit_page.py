"""The console's audit page: every decision about dead messages (requeue, resolve) and about
tasks (cancel), newest first, of both kinds or one, by any operator or one, paged by each
kind's own ids."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlencode

from starlette.requests import Request
from starlette.responses import Response

from outbox.drivers.records import AUDIT_KINDS, AuditedPage, AuditKind
from outbox.redaction import shown_value
from outbox_cli.console.filters import LARGEST_ID
from outbox_cli.console.pages import PAGE_SIZE, Pages

KINDS: dict[str, tuple[AuditKind, ...]] = {
    "all": AUDIT_KINDS,
    "replies": ("reply",),
    "tasks": ("task",),
}
"""The kind filter's choices, and the kinds of decision each lists."""
STARTS: dict[AuditKind, str] = {"reply": "before", "task": "task_before"}
"""The query parameter each kind's page starts before (`before`: the reply decisions', as
the page named it when it listed no other kind)."""


class AuditPage:
    """GET /audit: the decisions, newest first; `kind` keeps replies' or tasks', `by` one
    operator's, `before` and `task_before` page."""

    def __init__(self, pages: Pages) -> None:
        """Read and render through `pages`."""
        self.pages = pages

    def page(self, request: Request) -> Response:
        """The page of decisions the query asks for; 400 for a bad `kind` or start."""
        params = request.query_params
        by = params.get("by", "").strip() or None
        kind = params.get("kind", "").strip() or "all"
        shown: dict[str, Any] = {"by": by, "kind": kind, "kinds": KINDS}
        starts = {name: params.get(name, "") for name in STARTS.values()}
        try:
            chosen = audited_page(kind, by, starts)
        except ValueError as exc:
            return self.pages.render(
                request, "audit.html", 400, rows=[], error=str(exc), older=None, **shown
            )
        ops = self.pages.ops
        with ops.engine.connect() as conn:
            rows = ops.driver.audit_page(conn, chosen)
        older = None
        if len(rows) > PAGE_SIZE:
            narrowed = (("by", by), ("kind", None if kind == "all" else kind))
            kept = {name: value for name, value in narrowed if value}
            older = urlencode({**kept, **older_starts(chosen, rows, PAGE_SIZE)})
        return self.pages.render(
            request, "audit.html", rows=rows[:PAGE_SIZE], error=None, older=older, **shown
        )


def audited_page(kind: str, by: str | None, starts: dict[str, str]) -> AuditedPage:
    """The driver's page of the kind filter `kind`, by `by`, each kind before the id its
    start parameter in `starts` gives; ValueError names a bad one."""
    if kind not in KINDS:
        raise ValueError(f"kind: one of {', '.join(KINDS)}, not {shown_value(kind)}")
    reply_before = audit_start(STARTS["reply"], starts.get(STARTS["reply"], ""))
    task_before = audit_start(STARTS["task"], starts.get(STARTS["task"], ""))
    # One more of each kind than a page shows: more than a page in all says an older one.
    return AuditedPage(KINDS[kind], by, reply_before, task_before, PAGE_SIZE + 1)


def older_starts(page: AuditedPage, rows: list[dict[str, Any]], shown: int) -> dict[str, int]:
    """Where the page after the first `shown` of `rows` starts, for each kind of `page`:
    before the last of that kind shown; if none was, where this page started."""
    starts: dict[str, int] = {}
    for kind in page.kinds:
        ids = [int(row["id"]) for row in rows if row["kind"] == kind]
        listed = [int(row["id"]) for row in rows[:shown] if row["kind"] == kind]
        start = page.reply_before if kind == "reply" else page.task_before
        if listed:
            start = min(listed)
        elif start is None:
            # A first page pins the kinds it showed none of to what it read (above the
            # newest read, or, of none, below any id), so that a decision made since waits
            # for a first page rather than turn up among older ones.
            start = max(ids) + 1 if ids else 1
        starts[STARTS[kind]] = start
    return starts


def audit_start(name: str, given: str) -> int | None:
    """The decision id a page starts before (None: the newest), from parameter `name`;
    ValueError if not one."""
    given = given.strip()
    if not given:
        return None
    try:
        start = int(given)
    except ValueError:
        start = -1
    if not 0 < start <= LARGEST_ID:
        raise ValueError(f"{name}: not a decision id: {shown_value(given)}")
    return start
