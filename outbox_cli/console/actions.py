"""The console's decisions beyond one requeue: resolve one dead reply, cancel one task, and
requeue or resolve every dead reply a filter chooses, counted first, then confirmed.

Each goes through outbox.decisions, as `outbox dead requeue` and `outbox dead resolve` do,
with the operator the session names (Pages.operator_of), never a name from the form. A
bulk decision is about the replies counted: the console keeps their ids with the count's
confirmation, and the decision is about those alone (each still dead), so replies that
match the filter meanwhile are left for a later decision. The count's confirmation is
used once, by the session that counted, for the same action and filter, within
CONFIRM_SECONDS; the reason confirmed is the one the count showed.
"""

from __future__ import annotations

import argparse
import logging
from collections import Counter
from typing import Any
from urllib.parse import urlencode

from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

from outbox import decisions
from outbox.dead_filter import DeadFilter
from outbox.decisions import BULK_LIMIT, Decision
from outbox.errors import NotDead, TaskNotCancelled
from outbox.states import MessageState
from outbox_cli.console.confirmations import Confirmations
from outbox_cli.console.filters import FILTERS, dead_filter
from outbox_cli.console.forms import checked_form
from outbox_cli.console.pages import Pages
from outbox_cli.requeue import DestinationLookups

log = logging.getLogger("outbox.console")
BULK_ACTIONS = ("requeue", "resolve")
BULK = "bulk"
"""The one slot of a session's bulk confirmation: a new count replaces the last one's."""
REFUSED_SHOWN = 50
"""Refused replies a bulk decision's result lists by name (the rest are counted)."""
NO_REASON = "a reason is required: the audit keeps it"
NOT_CONFIRMED = (
    "this confirmation is not valid (used, expired, or issued to another session): count again"
)


class Actions:
    """The decision handlers, rendering through `pages` (its operator, read-only, CSRF)."""

    def __init__(self, pages: Pages, confirmations: Confirmations) -> None:
        """Decide through `pages`' Operations; bulk counts are confirmed by `confirmations`."""
        self.pages = pages
        self.confirmations = confirmations

    async def resolve(self, request: Request) -> Response:
        """POST /reply/resolve: resolve one dead reply for good, then show it."""
        form = await self._form(request)
        reply_id = form.get("reply_id", "")
        reason = form.get("reason", "").strip()
        operator, why, status = self._decider(request, reason)
        if operator is not None:
            try:
                [done] = await run_in_threadpool(
                    decisions.resolve, self.pages.ops, reply_id, reason=reason, by=operator
                )
            except NotDead as exc:
                why = not_dead(reply_id, exc)
            else:
                if done.audit is not None:
                    query = urlencode({"id": reply_id, "resolved": done.audit["id"]})
                    return RedirectResponse(f"/reply?{query}", status_code=303)
                why = done.why
        return await self.pages.reply_refused(
            request, reply_id, "resolved", why or "", reason, status
        )

    async def cancel(self, request: Request) -> Response:
        """POST /task/cancel: cancel one pending or running task for good, then show it."""
        form = await self._form(request)
        task_id = form.get("task_id", "")
        reason = form.get("reason", "").strip()
        operator, why, status = self._decider(request, reason)
        if operator is not None:
            try:
                audit = await run_in_threadpool(
                    self.pages.ops.cancel_task,
                    task_id,
                    reason=reason,
                    by=operator,
                    reply_destination=self.pages.reply_destination,
                )
            except TaskNotCancelled as exc:
                why = str(exc)
            else:
                query = urlencode({"id": task_id, "cancelled": audit["id"]})
                return RedirectResponse(f"/task?{query}", status_code=303)
        task = await run_in_threadpool(self.pages.reads.task, task_id)
        if task is None:
            return self.pages.render(request, "missing.html", 404, what="task", wanted=task_id)
        return self.pages.task_page(request, task, status, refused=why, reason=reason)

    async def bulk(self, request: Request) -> Response:
        """POST /dead/bulk: count the dead replies a filter chooses (step "count"), or decide
        about the counted ones once confirmed (step "confirm")."""
        form = await self._form(request)
        action = form.get("action", "")
        if action not in BULK_ACTIONS:
            raise HTTPException(400, f"action must be one of {', '.join(BULK_ACTIONS)}")
        filters = {name: form.get(name, "") for name in FILTERS}
        try:
            chosen = dead_filter(filters)
        except (argparse.ArgumentTypeError, ValueError) as exc:
            return self._page(request, 400, action, filters, error=str(exc))
        operator = self.pages.operator_of(request)
        if operator is None:
            return self._page(request, 403, action, filters, error=self.pages.nameless())
        if form.get("step") == "confirm":
            return await self._confirmed(request, form, action, filters, chosen, operator)
        reason = form.get("reason", "").strip()
        if not reason:
            return self._page(request, 400, action, filters, error=NO_REASON)
        rows = await run_in_threadpool(self.pages.ops.dead, BULK_LIMIT + 1, chosen)
        count = min(len(rows), BULK_LIMIT)
        if not count:
            return self._page(request, 200, action, filters, counted=0, reason=reason)
        ids = tuple(int(row["id"]) for row in rows[:count])
        # One bulk confirmation per session, the latest count's: up to BULK_LIMIT ids each.
        key = bulk_key(action, chosen, count)
        confirm = self.confirmations.issue(self.pages.holder(request), BULK, key, reason, ids)
        return self._page(
            request,
            200,
            action,
            filters,
            counted=count,
            more=len(rows) > BULK_LIMIT,
            reason=reason,
            confirm=confirm,
        )

    async def _confirmed(
        self,
        request: Request,
        form: dict[str, str],
        action: str,
        filters: dict[str, str],
        chosen: DeadFilter,
        operator: str,
    ) -> Response:
        """Decide about the replies a count confirmed, and show what was done."""
        try:
            count = int(form.get("count", ""))
        except ValueError:
            return self._page(request, 400, action, filters, error=NOT_CONFIRMED)
        key = bulk_key(action, chosen, count)
        held = self.confirmations.redeem(self.pages.holder(request), BULK, form.get("confirm", ""))
        if held is None or held.receipt != key:
            return self._page(request, 409, action, filters, error=NOT_CONFIRMED)
        counted = DeadFilter(ids=held.ids)
        done = await run_in_threadpool(self._decide, action, counted, held.reason, operator, count)
        outcomes = Counter(decision.outcome for decision in done)
        refused = [d for d in done if d.outcome == "refused"]
        log.info(
            "console: %s decided to %s %d dead replies matching %s: %s",
            operator,
            action,
            count,
            describe(filters),
            dict(outcomes),
        )
        return self._page(
            request,
            200,
            action,
            filters,
            counted=count,
            reason=held.reason,
            outcomes=sorted(outcomes.items()),
            refused=refused[:REFUSED_SHOWN],
            refused_total=len(refused),
        )

    def _decide(
        self, action: str, chosen: DeadFilter, reason: str, operator: str, limit: int
    ) -> list[Decision]:
        """Requeue (each after its receipt lookup, never forced) or resolve the chosen."""
        ops = self.pages.ops
        if action == "resolve":
            return decisions.resolve(ops, chosen, reason=reason, by=operator, limit=limit)
        lookup = DestinationLookups(self.pages.config)
        requeued = decisions.requeue(
            ops, chosen, reason=reason, by=operator, lookup=lookup, limit=limit
        )
        return list(requeued)

    def _decider(self, request: Request, reason: str) -> tuple[str | None, str | None, int]:
        """Who decides through `request` (None when no one may), and else why not and the
        status that says so (403 without an operator, 400 without a reason); a decision
        refused later answers 409."""
        operator = self.pages.operator_of(request)
        if operator is None:
            return None, self.pages.nameless(), 403
        if not reason:
            return None, NO_REASON, 400
        return operator, None, 409

    async def _form(self, request: Request) -> dict[str, str]:
        """The POSTed form, CSRF-checked; 403 on a read-only console."""
        if self.pages.read_only:
            raise HTTPException(403, "the console is read-only")
        return await checked_form(request)

    def _page(
        self,
        request: Request,
        status: int,
        action: str,
        filters: dict[str, str],
        **shown: Any,
    ) -> Response:
        """The bulk decision's page: its count and confirmation, what it did, or why not."""
        context: dict[str, Any] = {
            "error": None,
            "counted": None,
            "more": False,
            "reason": "",
            "confirm": None,
            "outcomes": None,
            "refused": [],
            "refused_total": 0,
        }
        context.update(shown)
        return self.pages.render(
            request,
            "bulk.html",
            status,
            action=action,
            filters=filters,
            described=describe(filters),
            listed=urlencode({k: v for k, v in filters.items() if v.strip()}),
            **context,
        )


def bulk_key(action: str, chosen: DeadFilter, count: int) -> str:
    """What a count's confirmation is for, kept in it and compared at the confirmation: the
    action, the filter as parsed (a filter that reads differently confirms nothing), and
    the count."""
    return f"bulk {action} {chosen!r} count {count}"


def describe(filters: dict[str, str]) -> str:
    """A filter in words, for the page and the log."""
    given = [f"{name} {value.strip()!r}" for name, value in filters.items() if value.strip()]
    return ", ".join(given) if given else "no filter (every dead reply)"


def not_dead(reply_id: str, exc: NotDead) -> str:
    """Why a decision about `reply_id` was refused before anything changed."""
    if exc.state is None:
        return f"no message {reply_id!r}"
    return f"message is {exc.state}, not {MessageState.DEAD}"
