"""A batch stored item by item: an effect that raises fails its own item alone.

Each item runs under its own SAVEPOINT, in the batch's order. An effect that raises
rolls back its item alone (`retry`) and holds the later items of its ordering key
(`held`, not applied), so a key's messages are applied in order or not at all. On
an item's last allowed delivery it goes to the dead letters instead (`dead`),
holding nothing back.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import sqlalchemy as sa

from outbox.canonical import sha256_hex
from outbox.drivers.base import Driver, Now
from receiver.batch_result import BatchResult
from receiver.dead_letters import LastTry, bury
from receiver.effects import Effect, run_effects
from receiver.unavailable import LostRace, unavailable

log = logging.getLogger("outbox.receiver.store")


def accept_one_by_one(
    driver: Driver,
    conn: sa.Connection,
    now: Now,
    items: tuple[list[str], list[bytes], list[str | None]],
    effect: Effect,
    last_tries: Mapping[int, LastTry],
) -> BatchResult:
    """Store `items` (reply_ids, bodies, ordering keys) each under its own SAVEPOINT, in
    order; joins the caller's transaction."""
    reply_ids, bodies, keys = items
    digests = [sha256_hex(body) for body in bodies]
    statuses: list[str] = []
    inserted: dict[str, float] = {}
    held: dict[str, tuple[str, float]] = {}
    errors: dict[int, str] = {}
    blocked: set[str] = set()
    for index, (reply_id, body, key) in enumerate(zip(reply_ids, bodies, keys, strict=True)):
        if key is not None and key in blocked:
            statuses.append("held")
            continue
        savepoint = conn.begin_nested()
        # The receipt's own statement failing is the store's failure: it fails the batch.
        fresh = driver.insert_receipts(conn, [reply_id], [digests[index]], [body], now)
        if reply_id not in fresh:
            savepoint.commit()
            stored = driver.receipt(conn, reply_id)
            if stored is None:
                raise LostRace  # purged between our insert and our read
            if reply_id not in inserted:
                held[reply_id] = (stored.content_hash, stored.received_at)
            statuses.append("duplicate" if stored.content_hash == digests[index] else "conflict")
            continue
        try:
            run_effects(conn, effect, [(reply_id, fresh[reply_id], body)])
        except Exception as exc:
            if unavailable(exc) is not None:
                raise  # the database, not this item: the whole batch is retried
            savepoint.rollback()
            reason = f"effect raised {type(exc).__name__}"
            last = last_tries.get(index)
            if last is not None:
                bury(driver, conn, now, (reply_id, digests[index], body), last, exc)
                errors[index] = reason
                statuses.append("dead")
                continue  # its key is not blocked: a dead message holds nothing back
            log.error(
                "the effect of reply_id %s raised; its receipt is rolled back and it is "
                "to be sent again%s",
                reply_id,
                "" if key is None else ", with the later messages of its ordering key",
                exc_info=True,
                extra={"fields": {"reply_id": reply_id, "reason": reason}},
            )
            errors[index] = reason
            statuses.append("retry")
            if key is not None:
                blocked.add(key)
            continue
        savepoint.commit()
        inserted[reply_id] = fresh[reply_id]
        statuses.append("stored")
    return BatchResult(statuses, digests, inserted, held, errors)
