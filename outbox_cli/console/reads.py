"""What the console's pages read: `outbox status` and `outbox dead`'s own queries
(outbox.operations), the relay's per-destination figures, and a task or a message whole."""

from __future__ import annotations

import codecs
import json
from typing import Any, NamedTuple

from outbox.operations import Operations
from outbox.redaction import redact
from outbox.states import MessageState
from outbox_cli.console.health import (
    HOUR,
    Announced,
    DestinationHealth,
    destination_health,
    relays_announced,
    workers_announced,
)
from relay.figures import figures_from

BODY_SHOWN = 65_536
"""Bytes of a body the reply page shows; the rest is cut (body_bytes says how many)."""
TEXT_SHOWN = 65_536
"""Characters of a payload, a result or an error a page shows; the rest is cut."""
ERROR_SHOWN = 4_096
"""Characters of an error a page shows (the relay stores 500 at most; plain SQL, any)."""
ERROR_LISTED = 1_024
"""Characters of each last error the dead list shows (a page holds 50 rows)."""
CUT = "\n…"
ATTEMPTS_SHOWN = 100
"""A reply page's timeline shows this many of its newest failed attempts (a message
requeued again and again may have many)."""


class Health(NamedTuple):
    """The overview's health rows: destinations worst first, relays, workers."""

    destinations: list[DestinationHealth]
    relays: list[Announced]
    workers: list[Announced]


class ConsoleReads:
    """Reads for the pages, on the engine of the Operations that `outbox dead` uses."""

    def __init__(self, ops: Operations) -> None:
        """Read through `ops` and its engine."""
        self.ops = ops

    def health(self, now: float) -> Health:
        """What the overview's health rows judge, read at `now` (the database's time)."""
        with self.ops.engine.connect() as conn:
            rows = self.ops.driver.destination_figures(conn, now)
            announced = self.ops.driver.relay_announcements(conn)
            workers = self.ops.driver.worker_announcements(conn)
            dead = self.ops.driver.dead_since(conn, now - HOUR)
        routed = {row.destination for row in announced if row.expires_at > now}
        figures = figures_from(rows, routed, ())
        return Health(
            destination_health(figures.destinations, dead, announced, now),
            relays_announced(announced, now),
            workers_announced(workers, now),
        )

    def reply(self, reply_id: str) -> dict[str, Any] | None:
        """One message's delivery record, its body shown as text, its decisions and its newest
        failed attempts."""
        message = self.ops.message(reply_id)
        if message is None:
            return None
        message["body_text"] = body_text(bytes(message.pop("body")))
        message["last_error"] = shown_error(message["last_error"])
        with self.ops.engine.connect() as conn:
            decisions = self.ops.driver.decisions(conn, reply_id)
            failures = self.ops.driver.failed_attempts(
                conn, message["id"], ATTEMPTS_SHOWN, message["created_at"]
            )
        message["decisions"] = [
            {**row, "previous_error": shown_error(row["previous_error"])} for row in decisions
        ]
        message["failed_attempts"] = [
            {**row, "error": shown_error(row["error"], ERROR_LISTED)} for row in failures
        ]
        message["timeline"] = timeline(message)
        return message

    def task(self, task_id: str) -> dict[str, Any] | None:
        """One task, with its payload and result pretty-printed, its reply and its
        decisions."""
        with self.ops.engine.connect() as conn:
            task = self.ops.driver.task(conn, task_id)
            if task is None:
                return None
            reply = self.ops.driver.reply_of(conn, task_id)
            decided = self.ops.driver.task_decisions(conn, task_id)
        task["payload"] = shown_json(task["payload"])
        task["result"] = None if task["result"] is None else shown_json(task["result"])
        task["last_error"] = shown_error(task["last_error"])
        task["reply"] = reply
        task["decisions"] = decided
        return task

    def message_exists(self, reply_id: str) -> bool:
        """Whether a message has this reply_id."""
        with self.ops.engine.connect() as conn:
            return self.ops.driver.message_exists(conn, reply_id)


class Moment(NamedTuple):
    """One line of a reply's timeline: when, what, and what it says."""

    at: float
    what: str
    said: str


def timeline(message: dict[str, Any]) -> list[Moment]:
    """A reply's story from what is kept of it, oldest first: created; each failed attempt
    (a retry, a death, a lease that expired), with its status and error; each decision
    about it, with the attempts, status and error it replaced; sent or resolved."""
    moments = [Moment(message["created_at"], "created", f"for {message['destination']}")]
    moments += [attempt_moment(attempt) for attempt in message["failed_attempts"]]
    for decision in message["decisions"]:
        before = f"after {decision['previous_attempts']} attempts"
        if decision["previous_status"] is not None:
            before += f", last status {decision['previous_status']}"
        if decision["previous_error"]:
            before += f": {decision['previous_error']}"
        why = f"by {decision['requested_by']} ({decision['reason']}), {before}"
        moments.append(Moment(decision["requested_at"], f"{decision['action']}d", why))
    if message["sent_at"] is not None:
        moments.append(Moment(message["sent_at"], "sent", f"after {message['attempts']} attempts"))
    resolved_by_decision = any(d["action"] == "resolve" for d in message["decisions"])
    if message["resolved_at"] is not None and not resolved_by_decision:
        # Resolved by plain SQL, with no audit row: the moment alone.
        moments.append(Moment(message["resolved_at"], "resolved", "never to be delivered"))
    # Stable: a failed attempt and the decision it led to may share a second.
    return sorted(moments, key=lambda moment: moment.at)


def attempt_moment(attempt: dict[str, Any]) -> Moment:
    """A failed attempt as a line of the timeline: which, what came of it, and why."""
    came = "dead" if attempt["state"] == MessageState.DEAD else "retry"
    said = f"attempt {attempt['attempt']}"
    if attempt["status"] is not None:
        said += f", status {attempt['status']}"
    if attempt["error"]:
        said += f": {attempt['error']}"
    return Moment(attempt["attempted_at"], came, said)


def pretty(text: str) -> str:
    """JSON text indented for reading; anything else (too deep to parse, too) as it is."""
    try:
        return json.dumps(json.loads(text), indent=2, ensure_ascii=False, sort_keys=True)
    except (ValueError, RecursionError):
        # Stored by plain SQL, a payload may be nested deeper than the parser recurses.
        return text


def cut(text: str, limit: int = TEXT_SHOWN) -> str:
    """`text`, or its first `limit` characters and a mark that the rest is cut."""
    return text if len(text) <= limit else text[:limit] + CUT


def shown_json(text: str) -> str:
    """Stored JSON text as a page shows it: pretty-printed when short enough, always cut."""
    if len(text) > TEXT_SHOWN:
        return cut(text)
    # Cut again: indenting a deeply nested value grows it with the square of its depth.
    return cut(pretty(text))


def shown_error(text: str | None, limit: int = ERROR_SHOWN) -> str | None:
    """Error text as a page shows it: anything credential-like hidden, then cut."""
    if text is None:
        return None
    # Redacted whole, then cut: a credential cut in two would escape redaction.
    return cut(redact(text), limit)


def body_text(body: bytes) -> str | None:
    """A body as text for the page (JSON pretty-printed), or None when it is not UTF-8."""
    whole = len(body) <= BODY_SHOWN
    # Not final unless whole: the cut may split a character, which is not an error.
    decoder = codecs.getincrementaldecoder("utf-8")()
    try:
        text = decoder.decode(body[:BODY_SHOWN], final=whole)
    except UnicodeDecodeError:
        return None
    return cut(pretty(text)) if whole else text + CUT
