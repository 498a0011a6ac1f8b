"""The console's pages: overview, dead replies, one reply (and its requeue), one task, search.

Reads run in the thread pool (the handlers are plain functions); every page is a
Jinja2 template with autoescaping, so bodies and error texts are shown, never run.
"""

from __future__ import annotations

import argparse
import dataclasses
import threading
import time
from collections import OrderedDict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import jinja2
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.templating import Jinja2Templates

from outbox.operations import Operations
from outbox.states import MessageState
from outbox_cli.arguments import age_text
from outbox_cli.console import age_charts, charts, requeue_form
from outbox_cli.console.confirmations import Confirmations
from outbox_cli.console.filters import FILTERS, dead_filter, page_start
from outbox_cli.console.forms import CSRF_COOKIE, CSRF_FIELD, checked_form
from outbox_cli.console.reads import ERROR_LISTED, ConsoleReads, shown_error

HERE = Path(__file__).parent
PAGE_SIZE = 50
REFRESH_SECONDS = 30
"""How often the overview reloads itself while auto-refresh is on."""
CHARTED_KEPT = 16
"""Destinations whose chart counts the console keeps (and all replies'): each read whole
when first charted, then a few minutes at a refresh."""
ESTIMATE_OVER = 200_000
"""Rows of a table past which the overview estimates its final states' counts from the
database's statistics (PostgreSQL) rather than count its whole history at each refresh."""
NOT_CONFIRMED = (
    "force needs the confirmation this console gave when it refused this requeue, in this "
    "session, within the last {minutes} minutes, used once: requeue without force to be "
    "asked again"
)
NO_LOGIN_NAME = (
    "the audit records the name given at login, and this request has none: log in through "
    "the form (a bearer token names no one)"
)
NO_OPERATOR = (
    "no operator name for the audit: start the console with --operator NAME (or "
    "OUTBOX_CONSOLE_OPERATOR, or operator in the config file's [console])"
)


def iso(epoch: float | None) -> str:
    """Epoch seconds as UTC time for people; empty for None."""
    if epoch is None:
        return ""
    moment = datetime.fromtimestamp(epoch, UTC)
    return moment.isoformat(sep=" ", timespec="seconds").replace("+00:00", "Z")


def listed_error(text: str | None) -> str | None:
    """An error as a list shows it: redacted, then cut to ERROR_LISTED characters."""
    return shown_error(text, ERROR_LISTED)


def templates() -> Jinja2Templates:
    """The page templates, every value escaped whatever the file's name."""
    environment = jinja2.Environment(
        loader=jinja2.FileSystemLoader(HERE / "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
    )
    environment.filters["iso"] = iso
    environment.filters["age"] = age_text
    environment.filters["listed_error"] = listed_error
    return Jinja2Templates(env=environment)


class Pages:
    """The page handlers, on one Operations (the one `outbox dead` would open)."""

    def __init__(
        self,
        ops: Operations,
        config: str | None,
        read_only: bool,
        token: bool,
        operator: str | None = None,
        confirmations: Confirmations | None = None,
        reply_destination: str = "default",
    ) -> None:
        """`config` names the destinations' receipt lookups; `token`: whether one is required
        (then each session names its operator), else `operator` decides (None: no one);
        `confirmations` holds what a refusal lets be forced; a cancelled task's reply goes
        to `reply_destination`, as the worker's replies do."""
        self.ops = ops
        self.operator = operator
        self.confirmations = confirmations or Confirmations(time.monotonic)
        self.reads = ConsoleReads(ops)
        self.config = config
        self.reply_destination = reply_destination
        self.read_only = read_only
        self.token = token
        self.templates = templates()
        self._charted_lock = threading.Lock()
        self.every_destination = charts.SettledCounts()
        self.destination_counts: OrderedDict[str, charts.SettledCounts] = OrderedDict()

    def render(
        self, request: Request, name: str, status_code: int = 200, **context: Any
    ) -> Response:
        """A page, with what every page shows: the CSRF field, read-only, logout."""
        context.update(
            csrf_field=CSRF_FIELD,
            csrf=request.state.csrf,
            read_only=self.read_only,
            token=self.token,
            operator=self.operator_of(request),
            page=name.removesuffix(".html"),
        )
        return self.templates.TemplateResponse(request, name, context, status_code=status_code)

    def operator_of(self, request: Request) -> str | None:
        """Who acts through `request`: with a token, the name its session gave at login;
        without one, the configured operator. None: no one the audit could name."""
        if not self.token:
            return self.operator
        session = request.state.session
        return None if session is None else str(session.operator)

    def nameless(self) -> str:
        """Why a request without an operator may not requeue, and how to give one."""
        return NO_LOGIN_NAME if self.token else NO_OPERATOR

    def warm(self) -> None:
        """Do once, before the first request, what would make it slow: compile the
        templates and read the day of per-minute counts the charts keep."""
        environment = self.templates.env
        for name in environment.list_templates():
            environment.get_template(name)
        self._overview()

    def overview(self, request: Request) -> Response:
        """Health first (destinations worst first, relays, workers), then counts per state and
        the per-minute charts; auto-refreshed unless `?refresh=off`."""
        paused = request.query_params.get("refresh") == "off"
        # The charts of one destination's replies, if chosen (tasks have none); unknown
        # names chart nothing, as a filter that matches nothing lists nothing.
        chosen = request.query_params.get("chart", "").strip() or None
        page = self.render(request, "overview.html", **self._overview(chosen), refresh=not paused)
        if not paused:
            # The Refresh header rather than a <meta> refresh: the same reload, paused by the
            # link at the top of the page (a time limit a person can turn off, WCAG 2.2.1);
            # axe-core flags any <meta> refresh, whatever control the page gives.
            page.headers["Refresh"] = str(REFRESH_SECONDS)
        return page

    def _overview(self, destination: str | None = None) -> dict[str, Any]:
        """What the overview shows, as of the database's time; the charts of `destination`'s
        replies if the health rows name it (any other name charts every destination: each
        destination charted costs a day's read, which a made-up name must not buy)."""
        now = charts.database_now(self.ops)
        status = self.ops.status(estimate_over=ESTIMATE_OVER)
        health = self.reads.health(now)
        choices = sorted(row.name for row in health.destinations)
        unknown = destination if destination is not None and destination not in choices else None
        charted = None if unknown is not None else destination
        kept = self.charted(charted)
        counted = kept.counts(self.ops, now, charts.LONGEST)
        ages = kept.oldest(self.ops, now, charts.LONGEST)
        return {
            "charted": charted,
            "unknown_chart": unknown,
            "chart_choices": choices,
            "now": now,
            "health": health,
            "status": status,
            "charts": charts.charts(counted, now),
            "age_charts": age_charts.age_charts(ages, now),
            "age_colour": age_charts.COLOUR,
            "width": charts.WIDTH,
            "height": charts.HEIGHT,
            "refresh_seconds": REFRESH_SECONDS,
        }

    def charted(self, destination: str | None) -> charts.SettledCounts:
        """The kept counts of all replies' charts (always kept), or of one destination's: the
        CHARTED_KEPT most recently charted destinations are kept, each read whole once."""
        if destination is None:
            return self.every_destination
        with self._charted_lock:
            kept = self.destination_counts.pop(destination, None) or charts.SettledCounts(
                destination
            )
            self.destination_counts[destination] = kept
            while len(self.destination_counts) > CHARTED_KEPT:
                self.destination_counts.popitem(last=False)
            return kept

    def dead(self, request: Request) -> Response:
        """Dead replies, oldest first, filtered as `outbox dead list` filters them; paged."""
        params = request.query_params
        try:
            chosen = dead_filter({name: params.get(name, "") for name in FILTERS})
            after = page_start(params.get("after", ""))
        except (argparse.ArgumentTypeError, ValueError) as exc:
            return self.render(
                request,
                "dead.html",
                400,
                rows=[],
                error=str(exc),
                filters=params,
                more=None,
                after=None,
                first="",
            )
        rows = self.ops.dead(PAGE_SIZE + 1, dataclasses.replace(chosen, after=after))
        kept = {name: params[name] for name in FILTERS if params.get(name)}
        more = None
        if len(rows) > PAGE_SIZE:
            rows = rows[:PAGE_SIZE]
            # The id, not the reply_id: the next page holds even if that row is purged.
            more = urlencode({**kept, "after": rows[-1]["id"]})
        return self.render(
            request,
            "dead.html",
            rows=rows,
            error=None,
            filters=params,
            more=more,
            after=after,
            first=urlencode(kept),
            filter_names=FILTERS,
            nameless=self.nameless(),
        )

    def reply(self, request: Request) -> Response:
        """One message: body, attempts, last status and error, decisions, its task."""
        reply_id = request.query_params.get("id", "")
        message = self.reads.reply(reply_id) if reply_id else None
        if message is None:
            return self.render(request, "missing.html", 404, what="reply", wanted=reply_id)
        return self.reply_page(
            request,
            message,
            200,
            requeued=decided(message, "requeue", request.query_params.get("requeued")),
            resolved=decided(message, "resolve", request.query_params.get("resolved")),
        )

    def reply_page(
        self, request: Request, message: dict[str, Any], status: int, **shown: Any
    ) -> Response:
        """A reply's page answering `status`; `shown` sets what differs from a plain view
        (a refusal `done` of `verb`, a force's `confirm`, the `reason` kept, a decision
        just `requeued` or `resolved`)."""
        context: dict[str, Any] = {
            "done": None,
            "verb": "requeued",
            "confirm": None,
            "reason": "",
            "requeued": None,
            "resolved": None,
        }
        context.update(shown)
        return self.render(
            request,
            "reply.html",
            status,
            message=message,
            dead=message["state"] == MessageState.DEAD,
            nameless=self.nameless(),
            **context,
        )

    async def reply_refused(
        self, request: Request, reply_id: str, verb: str, why: str, reason: str, status: int
    ) -> Response:
        """The reply's page (answering `status`) saying a decision about it was refused, and
        why; `reason` stays in the decision's form."""
        message = await run_in_threadpool(self.reads.reply, reply_id)
        if message is None:
            return self.render(request, "missing.html", 404, what="reply", wanted=reply_id)
        done = requeue_form.refused(reply_id, why)
        return self.reply_page(request, message, status, done=done, verb=verb, reason=reason)

    async def requeue(self, request: Request) -> Response:
        """Requeue one dead message (POST), then show the reply; a refusal shown on it."""
        if self.read_only:
            raise HTTPException(403, "the console is read-only")
        form = await checked_form(request)
        reply_id = form.get("reply_id", "")
        reason = form.get("reason", "")
        # The name comes from the session (or the console's setting), never from the form:
        # a field named `by` is ignored.
        operator = self.operator_of(request)
        holder = self.holder(request)
        if operator is None:
            done = requeue_form.refused(reply_id, self.nameless())
        elif form.get("force") == "yes":
            held = self.confirmations.redeem(holder, reply_id, form.get("confirm", ""))
            if held is None:
                minutes = round(self.confirmations.seconds / 60)
                done = requeue_form.refused(reply_id, NOT_CONFIRMED.format(minutes=minutes))
            else:
                # The reason confirmed is the one the refusal showed, whatever the form says.
                reason = held.reason
                done = await run_in_threadpool(
                    requeue_form.requeue,
                    self.ops,
                    self.config,
                    reply_id,
                    reason=reason,
                    by=operator,
                    overriding=held.receipt,
                )
        else:
            done = await run_in_threadpool(
                requeue_form.requeue, self.ops, self.config, reply_id, reason=reason, by=operator
            )
        if done.outcome == "requeued" and done.audit is not None:
            query = urlencode({"id": reply_id, "requeued": done.audit["id"]})
            return RedirectResponse(f"/reply?{query}", status_code=303)
        message = await run_in_threadpool(self.reads.reply, reply_id)
        if message is None:
            return self.render(request, "missing.html", 404, what="reply", wanted=reply_id)
        confirm = (
            self.confirmations.issue(holder, reply_id, done.receipt, reason.strip())
            if requeue_form.forceable(done)
            else None
        )
        return self.reply_page(request, message, 409, done=done, confirm=confirm, reason=reason)

    def holder(self, request: Request) -> str:
        """Whose a force confirmation is: the login session's, or without a token the
        browser's (its CSRF cookie, which a POST has proved it holds)."""
        session = request.state.session
        if session is not None:
            return f"session:{session.nonce}"
        return f"browser:{request.cookies.get(CSRF_COOKIE, '')}"

    def task(self, request: Request) -> Response:
        """One task: payload, state, attempts, owner, fence, deadline, result, its reply, its
        decisions (and its cancel, while it is pending or running)."""
        task_id = request.query_params.get("id", "")
        task = self.reads.task(task_id) if task_id else None
        if task is None:
            return self.render(request, "missing.html", 404, what="task", wanted=task_id)
        cancelled = decided(task, "cancel", request.query_params.get("cancelled"))
        return self.task_page(request, task, 200, cancelled=cancelled)

    def task_page(
        self, request: Request, task: dict[str, Any], status: int, **shown: Any
    ) -> Response:
        """A task's page answering `status`; `shown` sets what differs from a plain view (a
        cancel `refused` and why, the `reason` kept, a cancel just done: `cancelled`)."""
        context: dict[str, Any] = {"refused": None, "reason": "", "cancelled": None}
        context.update(shown)
        return self.render(
            request,
            "task.html",
            status,
            task=task,
            nameless=self.nameless(),
            reply_destination=self.reply_destination,
            **context,
        )

    def search(self, request: Request) -> Response:
        """A reply_id or a task_id: its page, or a page saying neither exists."""
        wanted = request.query_params.get("q", "").strip()
        if wanted and self.reads.message_exists(wanted):
            return RedirectResponse(f"/reply?{urlencode({'id': wanted})}", status_code=303)
        if wanted and self.reads.task(wanted) is not None:
            return RedirectResponse(f"/task?{urlencode({'id': wanted})}", status_code=303)
        return self.render(request, "missing.html", 404, what="reply or task", wanted=wanted)


def decided(row: dict[str, Any], action: str, audit_id: str | None) -> str | None:
    """`audit_id` when it names an `action` decision about this task or reply (the banner
    of a decision just taken), else None: a link cannot claim a decision not taken."""
    taken = {str(d["id"]) for d in row["decisions"] if d["action"] == action}
    return audit_id if audit_id in taken else None
