"""Consume outbox messages from a broker with the receiver's dedupe: the broker-free core.

A broker consumer (receiver.nats_consumer, receiver.rabbitmq_consumer) hands each
batch of messages it fetched to ``Consumer.consume_batch``, which checks every
message (receiver.deliveries), stores the valid ones and runs the effect in ONE
transaction (``ReceiptStore.accept_many`` with ``isolate=True``: an effect that raises
fails only its own message and holds back the later ones of its ordering key), and
returns an outcome per message (receiver.outcomes). Only then does the broker module settle each
message:

- ``stored`` (first receipt, effect committed), ``duplicate`` (held with the same
  body: no second effect) and ``conflict`` (held with another body: logged as an
  error, nothing changed): acknowledged, never delivered again;
- ``invalid`` (a missing or malformed header, a signature that does not verify, a
  body whose SHA-256 differs from its ``outbox-content-hash`` header, a body that is
  not strict JSON): nothing stored, logged as an error, refused without requeue so the
  broker does not deliver it forever;
- ``retry`` (the store, or this message's effect, failed) and ``held`` (an earlier
  message of its ordering key is still to be applied, or its own effect raised less
  than its backoff ago: ``backoff``, doubling per failure up to ``backoff_cap``, before
  the effect runs again): nothing stored, not
  acknowledged; the broker delivers it again. When a batch settled nothing else, the
  consumer pauses (doubling, capped, jittered: outbox.backoff) before it takes more, so
  a database that is down is not hammered;
- ``dead`` (this message's effect raised on each of ``max_deliveries`` deliveries, or
  it was dead already and came again): kept in ``receiver_dead_letters`` with its
  reason in the batch's transaction (or already there), logged as an error,
  acknowledged, never delivered again. Only the effect's own failures count, in this
  process (a restart gives a message a fresh budget), each at least its backoff after
  the one before: a ``held`` message, or a batch the database failed whole, is not one.

Order across batches: a key whose message ended ``retry`` is *blocked* by that
message (by reply_id): a later message of the key that arrives first (the broker may
hand it over before the redelivery) is ``held``. The block ends when the blocking
message is stored, a duplicate, a conflict or dead, or when it has not come back
for ``key_hold`` seconds (it went to another consumer, or the broker gave up on it).
The messages of a key given back unapplied wait in the order the consumer first saw
them; when the blocker is settled, the first of them blocks the key in turn, since the
broker may hand them over again in any order (receiver.key_blocks). The blocks live in
this process only.

The signature is verified without a freshness limit: a message may wait in the broker
for hours while its consumer is down, and a replayed message is only a duplicate.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

from outbox import failpoints, tracing
from outbox.backoff import backoff_ceiling
from outbox.errors import ConfigError
from outbox.signing import ID_HEADER
from receiver.dead_letters import LastTry
from receiver.deliveries import Delivery, Invalid, check, ordering_key, shown_id, signing_keys
from receiver.effect_failures import EffectFailures
from receiver.effects import Effect
from receiver.errors import StoreUnavailable
from receiver.key_blocks import KeyBlocks
from receiver.metrics import ConsumerMetrics
from receiver.outcomes import REDELIVERED, Outcome
from receiver.spans import creation_context, processing, record_outcomes
from receiver.stoppable import Stoppable
from receiver.store import BatchItem, Statuses

_KNOWN: dict[str, Outcome] = {
    "stored": "stored",
    "duplicate": "duplicate",
    "held": "held",
    "dead": "dead",
}

BEFORE_ACK = "receiver.consume.before_ack"
DEFAULT_BATCH = 100
DEFAULT_BACKOFF = 0.5
DEFAULT_BACKOFF_CAP = 30.0
DEFAULT_MAX_DELIVERIES = 5
"""Deliveries whose effect raises before a message goes to the dead letters."""
DEFAULT_KEY_HOLD = 300.0
"""Seconds a key stays blocked by a message that failed and has not come back since: far
longer than the pause before a redelivery (backoff_cap) and JetStream's ack_wait."""

log = logging.getLogger("outbox.receiver.consume")


class BatchStore(Protocol):
    """What a consumer needs from a receipt store: ReceiptStore.accept_many."""

    def accept_many(
        self,
        items: Sequence[BatchItem],
        effect: Effect | None = None,
        *,
        isolate: bool = False,
        last_tries: Mapping[int, LastTry] | None = None,
    ) -> list[str]:
        """Store receipts in one transaction: stored, duplicate, conflict, retry, held, dead."""
        ...

    def dead_among(self, reply_ids: Sequence[str]) -> set[str]:
        """Which of `reply_ids` are in the dead letters."""
        ...


class Consumer(Stoppable):
    """The broker-free part of a consumer: consume batches, pause after failures, stop."""

    broker: str | None = None
    """The broker's name in a dead letter: nats, rabbitmq."""

    def __init__(
        self,
        store: BatchStore,
        *,
        secrets: Iterable[str | bytes] | None = None,
        unsigned: bool = False,
        effect: Effect | None = None,
        batch: int = DEFAULT_BATCH,
        backoff: float = DEFAULT_BACKOFF,
        backoff_cap: float = DEFAULT_BACKOFF_CAP,
        metrics: ConsumerMetrics | None = None,
        key_hold: float = DEFAULT_KEY_HOLD,
        max_deliveries: int = DEFAULT_MAX_DELIVERIES,
        continue_traces: bool = False,
    ) -> None:
        """Verify with `secrets` (or nothing, unsigned=True); run `effect` per first receipt;
        `key_hold`: seconds a key waits for its failed message to come back (see above);
        `max_deliveries`: deliveries whose effect raises before a message goes dead;
        `continue_traces`: a batch of one message's process span continues the publisher's
        trace rather than linking to it (receiver.spans)."""
        if batch < 1:
            raise ConfigError(f"batch must be >= 1, got {batch}")
        if isinstance(max_deliveries, bool) or not isinstance(max_deliveries, int):
            raise ConfigError(f"max_deliveries must be a whole number, got {max_deliveries!r}")
        if max_deliveries < 1:
            raise ConfigError(f"max_deliveries must be >= 1, got {max_deliveries}")
        if not 0 < backoff <= backoff_cap:
            raise ConfigError("backoff must be > 0 and at most backoff_cap")
        if not key_hold > 0:
            raise ConfigError("key_hold must be > 0 seconds")
        super().__init__()
        self.store = store
        self.keys = signing_keys(secrets, unsigned)
        self.effect = effect
        self.batch = batch
        self.backoff = backoff
        self.backoff_cap = backoff_cap
        self.metrics = metrics or ConsumerMetrics()
        self.key_hold = float(key_hold)
        self.max_deliveries = max_deliveries
        self.continue_traces = continue_traces
        self._effect_failures = EffectFailures(max_deliveries, backoff, backoff_cap)
        self._key_blocks = KeyBlocks(self.key_hold)
        self._failures = 0

    @property
    def source(self) -> str:
        """What the consumer reads, as its process spans name it: a stream, a queue."""
        return self.broker or "broker"

    def consume_batch_now(self, deliveries: Sequence[Delivery]) -> list[Outcome]:
        """Check, store and run the effect in one transaction; an outcome per delivery,
        in a process span when tracing is set up."""
        if not tracing.configured():
            return self._consumed(deliveries)
        with processing(
            self.broker or "",
            self.source,
            [delivery.headers.get(ID_HEADER, "") for delivery in deliveries],
            [creation_context(delivery.headers) for delivery in deliveries],
            continue_traces=self.continue_traces,
        ) as span:
            outcomes = self._consumed(deliveries)
            record_outcomes(span, outcomes)
        return outcomes

    def _consumed(self, deliveries: Sequence[Delivery]) -> list[Outcome]:
        """consume_batch_now's work, untraced."""
        now = _monotonic()
        self._key_blocks.unblock_expired(now)
        outcomes: list[Outcome] = ["invalid"] * len(deliveries)
        items: list[BatchItem] = []
        positions: list[int] = []
        redelivered: list[str] = []
        keyed: dict[int, tuple[str, str]] = {}  # index -> (ordering key, reply_id)
        for index, delivery in enumerate(deliveries):
            try:
                reply_id = check(delivery, self.keys)
            except Exception as exc:  # noqa: BLE001 - anyone may publish anything: refused
                # A message the checks themselves trip over is refused like any invalid
                # one, never left to stop the consumer (and everything behind it).
                reason = str(exc) if isinstance(exc, Invalid) else f"cannot be checked: {exc!r}"
                log.error(
                    "refused a broker message (not stored, not redelivered): %s",
                    reason,
                    extra={"fields": {"reply_id": shown_id(delivery), "reason": reason}},
                )
                # It does not release a key its reply_id blocks: the blocking message passed
                # these checks, so this is another message under its id (a forgery).
                continue
            key = ordering_key(delivery)
            if key is not None:
                keyed[index] = (key, reply_id)
            blocker = self._key_blocks.blocker(key)
            if blocker is not None and blocker != reply_id:
                outcomes[index] = "held"
                continue
            if self._effect_failures.backing_off(reply_id, now):
                # Its effect raised moments ago: not tried again (nor counted) before its
                # own backoff, so a passing fault does not spend max_deliveries at once.
                outcomes[index] = "held"
                if key is not None:
                    # Now, not after the store: its key's later messages in this batch
                    # must not pass it (its key is free once a block expired).
                    self._key_blocks.keep(key, reply_id, now)
                continue
            items.append(
                (reply_id, delivery.body) if key is None else (reply_id, delivery.body, key)
            )
            positions.append(index)
            if delivery.redelivered:
                redelivered.append(reply_id)
        if items:
            chosen = [deliveries[index] for index in positions]
            statuses = self._store(items, chosen, redelivered)
            for index, item, status in zip(positions, items, statuses, strict=True):
                outcomes[index] = status
                if len(item) == 3 and item[2] is not None:
                    self._key_blocks.follow(item[2], item[0], status, now)
        for index, (key, reply_id) in keyed.items():
            if outcomes[index] in REDELIVERED:
                # Given back, it may come again after a later message of its key: the key
                # then waits for the first of its messages given back (KeyBlocks).
                self._key_blocks.keep(key, reply_id, now)
        for outcome in outcomes:
            self.metrics.consumed.labels(outcome).inc()
        return outcomes

    def _store(
        self,
        items: Sequence[BatchItem],
        deliveries: Sequence[Delivery],
        redelivered: Sequence[str] = (),
    ) -> list[Outcome]:
        try:
            # Only a message delivered before can have gone dead (its ack lost after the
            # commit that buried it): a first delivery costs no read.
            buried = self.store.dead_among(redelivered) if redelivered else set()
            fresh = [index for index, item in enumerate(items) if item[0] not in buried]
            if buried:
                for item in items:
                    if item[0] in buried:
                        log.warning(
                            "reply_id %s is in the dead letters already: acknowledged, nothing "
                            "stored (outbox receiver dead retry applies it)",
                            item[0],
                            extra={"fields": {"reply_id": item[0]}},
                        )
            taken = [items[index] for index in fresh]
            last_tries = self._effect_failures.last_tries(
                taken, [deliveries[index] for index in fresh], self.broker
            )
            with self.metrics.commit_seconds.time():
                # last_tries only when some item is on its last try: a store of an
                # application's own written before dead letters still works until then.
                more = {"last_tries": last_tries} if last_tries else {}
                stored = (
                    self.store.accept_many(taken, self.effect, isolate=True, **more)
                    if taken
                    else Statuses()
                )
            self._effect_failures.count(taken, stored, _monotonic())
            statuses: list[str] = ["dead"] * len(items)
            for index, status in zip(fresh, stored, strict=True):
                statuses[index] = status
        except StoreUnavailable as exc:
            log.warning("receipt store unavailable; the messages will come again: %s", exc)
            return ["retry"] * len(items)
        except Exception:
            log.exception("storing %d message(s) failed; they will come again", len(items))
            return ["retry"] * len(items)
        outcomes: list[Outcome] = []
        for item, status in zip(items, statuses, strict=True):
            if status == "conflict":
                log.error(
                    "reply_id %s is held with another body: acknowledged, nothing changed",
                    item[0],
                    extra={"fields": {"reply_id": item[0]}},
                )
                outcomes.append("conflict")
            else:
                # retry (the store logged the effect's traceback), or a status this
                # consumer does not know: never acknowledged unless known to be done.
                outcomes.append(_KNOWN.get(status, "retry"))
        return outcomes

    async def consume_batch(self, deliveries: Sequence[Delivery]) -> list[Outcome]:
        """consume_batch_now on a thread (the transaction blocks), then the before-ack point."""
        outcomes = await asyncio.to_thread(self.consume_batch_now, deliveries)
        failpoints.hit(BEFORE_ACK)
        # Paused only when nothing was settled: a message that keeps failing must not
        # slow the other keys down, but a database that is down must not be hammered.
        settled = any(outcome not in REDELIVERED for outcome in outcomes)
        self._failures = 0 if settled else self._failures + 1
        return outcomes

    def retry_delay(self) -> float:
        """The pause before taking more messages: 0 unless the last batch is to be retried."""
        # The backoff's ceiling, not a jittered draw below it: a message that failed alone
        # waits exactly its own backoff (EffectFailures), and a pause that ended first
        # would find it still held back, count one more failed batch and double again.
        if self._failures == 0:
            return 0.0
        return backoff_ceiling(self._failures, self.backoff, self.backoff_cap)


def _monotonic() -> float:
    """The clock of the key blocks (a test moves it)."""
    return time.monotonic()
