"""Dead letters: what a broker consumer keeps of a message whose effect raised on its last
allowed delivery, written in the transaction that gives up on it."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass

import sqlalchemy as sa

from outbox.drivers.base import Driver, Now
from outbox.one_line import one_line
from outbox.redaction import redact

REASON_CHARS = 500
"""A dead letter's reason keeps this much of the exception's (redacted) text."""

log = logging.getLogger("outbox.receiver.store")


@dataclass(frozen=True)
class LastTry:
    """What to keep of a message on its last allowed delivery, should its effect raise now."""

    headers: Mapping[str, str]
    """Headers worth keeping (a consumer leaves the signature out)."""
    failures: int
    """Deliveries whose effect raised, this one included."""
    deliveries: int | None = None
    """The broker's own count of deliveries, when it gives one."""
    broker: str | None = None
    """nats or rabbitmq."""
    broker_ref: str | None = None
    """Where the broker kept it: stream and sequence, or queue."""


def dead_reason(exc: BaseException) -> str:
    """A dead letter's reason: the exception's class and the start of its redacted text."""
    text = one_line(redact(str(exc)), REASON_CHARS)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def bury(
    driver: Driver,
    conn: sa.Connection,
    now: Now,
    message: tuple[str, str, bytes],
    last: LastTry,
    exc: BaseException,
) -> None:
    """Write a message, (reply_id, content hash, body), whose effect raised on its last try to
    the dead letters; log it. Joins the caller's transaction."""
    reply_id, content_hash, body = message
    reason = dead_reason(exc)
    row = {
        "reply_id": reply_id,
        "content_hash": content_hash,
        "body": body,
        "headers": json.dumps(dict(sorted(last.headers.items())), ensure_ascii=False),
        "reason": reason,
        "failures": last.failures,
        "deliveries": last.deliveries,
        "broker": last.broker,
        "broker_ref": last.broker_ref,
    }
    driver.insert_dead_letter(conn, row, now)
    log.error(
        "the effect of reply_id %s raised on its last allowed delivery (%d failures): it "
        "is kept in receiver_dead_letters and acknowledged, and the later messages of its "
        "ordering key go on",
        reply_id,
        last.failures,
        exc_info=True,
        extra={"fields": {"reply_id": reply_id, "reason": reason, "failures": last.failures}},
    )
