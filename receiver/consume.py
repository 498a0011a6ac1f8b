"""Consume outbox messages from a broker with the receiver's dedupe: the broker-free core.

A broker consumer (receiver.nats_consumer, receiver.rabbitmq_consumer) hands each
batch of messages it fetched to ``Consumer.decide``, which checks every message
(``check``), stores the valid ones and runs the effect in ONE transaction
(``ReceiptStore.accept_many`` with ``isolate=True``: an effect that raises fails
only its own message and holds back the later ones of its ordering key), and
returns an outcome per message. Only then does the broker module settle each
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
  consumer pauses (doubling, capped) before it takes more, so a database that is down
  is not hammered;
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
The blocks live in this process only.

The signature is verified without a freshness limit: a message may wait in the broker
for hours while its consumer is down, and a replayed message is only a duplicate.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, TypeVar

from outbox import failpoints
from outbox.canonical import sha256_hex
from outbox.errors import ConfigError, SignatureError, StoreUnavailable
from outbox.messages import ORDERING_KEY, is_reply_id
from outbox.signing import (
    CONTENT_HASH_HEADER,
    ID_HEADER,
    ORDERING_KEY_HEADER,
    SigningKey,
    is_broker_message_id,
    parse_secret,
    verify,
)
from receiver.dead_letters import LastTry
from receiver.effects import Effect
from receiver.metrics import ConsumerMetrics
from receiver.store import BatchItem, Statuses
from receiver.strict_json import InvalidJSON, check_strict_json

T = TypeVar("T")
CANCEL_AGAIN = 0.1
"""Seconds between cancellations of a wait that a stop ends (see unless_stopped)."""

Outcome = Literal["stored", "duplicate", "conflict", "invalid", "retry", "held", "dead"]
ACKNOWLEDGED: frozenset[Outcome] = frozenset({"stored", "duplicate", "conflict", "dead"})
"""Outcomes the broker is told are done with: they are never delivered again."""
REDELIVERED: frozenset[Outcome] = frozenset({"retry", "held"})
"""Outcomes left to the broker to deliver again: nothing of them was applied."""

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
FAILURES_KEPT = 10_000
"""Messages whose effect failures a consumer counts at once; past it the oldest count is
forgotten (that message then gets a fresh budget: more tries, never fewer)."""
UNKEPT_HEADERS = frozenset({"webhook-signature", "authorization", "proxy-authorization", "cookie"})
"""Headers a dead letter leaves out: credentials, and a signature nobody needs again."""
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


@dataclass(frozen=True)
class Delivery:
    """One broker message: its headers (names lowercased), exact body, broker message id;
    what the broker says of its deliveries, and where it keeps it (for a dead letter)."""

    headers: Mapping[str, str]
    body: bytes
    broker_id: str | None = None
    redelivered: bool = False
    """The broker delivered it before (a lost ack, a requeue, a nak)."""
    deliveries: int | None = None
    """The broker's count of its deliveries, this one included, when it keeps one."""
    broker_ref: str | None = None
    """Where the broker keeps it: a stream and sequence, a queue."""


class Invalid(ValueError):
    """A message that can never be accepted; its text says why."""


def signing_keys(secrets: Iterable[str | bytes] | None, unsigned: bool) -> tuple[SigningKey, ...]:
    """The keys to verify with; unsigned=True (and no secrets) checks no signature."""
    if isinstance(secrets, str | bytes):
        raise TypeError("secrets must be a list of secrets, not one secret")
    keys = tuple(parse_secret(secret) for secret in secrets or ())
    if unsigned and keys:
        raise ConfigError("secrets and unsigned=True: choose one")
    if not unsigned and not keys:
        raise ConfigError("no secret to verify signatures: give secrets, or unsigned=True")
    return keys


def check(delivery: Delivery, keys: Sequence[SigningKey]) -> str:
    """The message's reply_id, or Invalid; no keys: the signature is not checked."""
    headers = delivery.headers
    reply_id = headers.get(ID_HEADER)
    if not is_reply_id(reply_id):
        raise Invalid(f"missing or malformed {ID_HEADER} header")
    assert reply_id is not None
    broker_id = delivery.broker_id
    if broker_id is not None and not is_broker_message_id(
        broker_id, reply_id, keys, unsigned=not keys
    ):
        raise Invalid(f"the broker's message id is neither {ID_HEADER} nor derived from it")
    if keys:
        try:
            # No freshness limit: the broker may have held the message for hours.
            verify(keys, headers, delivery.body, tolerance=math.inf)
        except SignatureError as exc:
            raise Invalid(f"signature: {exc}") from exc
    declared = headers.get(CONTENT_HASH_HEADER)
    if declared is None:
        raise Invalid(f"missing {CONTENT_HASH_HEADER} header")
    if declared != sha256_hex(delivery.body):
        raise Invalid(f"the body's SHA-256 differs from its {CONTENT_HASH_HEADER} header")
    try:
        check_strict_json(delivery.body)
    except InvalidJSON as exc:
        raise Invalid(f"body is not strict JSON: {exc}") from exc
    ordering_key(delivery)
    return reply_id


def ordering_key(delivery: Delivery) -> str | None:
    """The message's ordering key (None: it has none), or Invalid when malformed."""
    key = delivery.headers.get(ORDERING_KEY_HEADER)
    if key is not None and not ORDERING_KEY.fullmatch(key):
        raise Invalid(f"malformed {ORDERING_KEY_HEADER} header")
    return key


class Consumer:
    """The broker-free part of a consumer: decide on batches, pause after failures, stop."""

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
    ) -> None:
        """Verify with `secrets` (or nothing, unsigned=True); run `effect` per first receipt;
        `key_hold`: seconds a key waits for its failed message to come back (see above);
        `max_deliveries`: deliveries whose effect raises before a message goes dead."""
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
        self.store = store
        self.keys = signing_keys(secrets, unsigned)
        self.effect = effect
        self.batch = batch
        self.backoff = backoff
        self.backoff_cap = backoff_cap
        self.metrics = metrics or ConsumerMetrics()
        self.key_hold = float(key_hold)
        self.max_deliveries = max_deliveries
        self._effect_failures: collections.OrderedDict[str, tuple[int, float]] = (
            collections.OrderedDict()
        )
        """Per reply_id whose effect raised: how often, and when it may be tried again."""
        """reply_id -> deliveries whose effect raised, in this process (see FAILURES_KEPT)."""
        self._blocked: dict[str, tuple[str, float]] = {}
        """Ordering key -> (reply_id of its message to be applied first, monotonic deadline)."""
        self._failures = 0
        self._stopping: asyncio.Event | None = None
        self._stop_requested = False

    @property
    def stopping(self) -> bool:
        """Whether stop() was called."""
        return self._stop_requested

    def stop(self) -> None:
        """Stop after the messages in hand are committed and settled (callable from a signal)."""
        self._stop_requested = True
        if self._stopping is not None:
            self._stopping.set()

    def _stop_event(self) -> asyncio.Event:
        if self._stopping is None:
            self._stopping = asyncio.Event()
            if self._stop_requested:
                self._stopping.set()
        return self._stopping

    def decide_now(self, deliveries: Sequence[Delivery]) -> list[Outcome]:
        """Check, store and run the effect in one transaction; an outcome per delivery."""
        now = _monotonic()
        self._unblock_expired(now)
        outcomes: list[Outcome] = ["invalid"] * len(deliveries)
        items: list[BatchItem] = []
        positions: list[int] = []
        redelivered: list[str] = []
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
                    extra={"fields": {"reply_id": _shown(delivery), "reason": reason}},
                )
                # It does not release a key its reply_id blocks: the blocking message passed
                # these checks, so this is another message under its id (a forgery).
                continue
            key = ordering_key(delivery)
            blocker = None if key is None else self._blocked.get(key)
            if blocker is not None and blocker[0] != reply_id:
                outcomes[index] = "held"
                continue
            failed = self._effect_failures.get(reply_id)
            if failed is not None and now < failed[1]:
                # Its effect raised moments ago: not tried again (nor counted) before its
                # own backoff, so a passing fault does not spend max_deliveries at once.
                outcomes[index] = "held"
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
                    self._follow(item[2], item[0], status, now)
        for outcome in outcomes:
            self.metrics.consumed.labels(outcome).inc()
        return outcomes

    def _follow(self, key: str, reply_id: str, outcome: Outcome, now: float) -> None:
        """Block `key` by the first of its messages to be retried; unblock once it is settled."""
        if outcome == "retry":
            blocker = self._blocked.get(key)
            if blocker is None or blocker[0] == reply_id:
                self._blocked[key] = (reply_id, now + self.key_hold)
        elif outcome in ACKNOWLEDGED:
            self._unblock(key, reply_id)

    def _unblock(self, key: str | None, reply_id: str | None) -> None:
        """Unblock `key` if `reply_id` is the message it waits for."""
        if key is not None and self._blocked.get(key, ("", 0.0))[0] == reply_id:
            del self._blocked[key]

    def _unblock_expired(self, now: float) -> None:
        """Give up waiting for failed messages that have not come back within key_hold."""
        for key, (reply_id, deadline) in list(self._blocked.items()):
            if deadline <= now:
                del self._blocked[key]
                log.warning(
                    "reply_id %s was not delivered again within %.0f s; the later messages "
                    "of its ordering key are no longer held back",
                    reply_id,
                    self.key_hold,
                    extra={"fields": {"reply_id": reply_id}},
                )

    def _last_tries(
        self, items: Sequence[BatchItem], deliveries: Sequence[Delivery]
    ) -> dict[int, LastTry]:
        """The items whose effect has raised max_deliveries - 1 times: this try is their last."""
        last: dict[int, LastTry] = {}
        for index, (item, delivery) in enumerate(zip(items, deliveries, strict=True)):
            failures = self._effect_failures.get(item[0], (0, 0.0))[0] + 1
            if failures >= self.max_deliveries:
                last[index] = LastTry(
                    headers={
                        name: value
                        for name, value in delivery.headers.items()
                        if name not in UNKEPT_HEADERS
                    },
                    failures=failures,
                    deliveries=delivery.deliveries,
                    broker=self.broker,
                    broker_ref=delivery.broker_ref,
                )
        return last

    def _count_failures(self, items: Sequence[BatchItem], statuses: Statuses | list[str]) -> None:
        """Count a failure for each item whose effect raised, and when it may be tried
        again (backoff, doubling per failure, capped); forget the settled ones."""
        errors = getattr(statuses, "errors", {})
        now = _monotonic()
        for index, (item, status) in enumerate(zip(items, statuses, strict=True)):
            reply_id = item[0]
            if status == "retry" and index in errors:
                # Only the effect's own failures count: not a held message, nor a batch the
                # database failed whole (that one raised before any status).
                failures = self._effect_failures.get(reply_id, (0, 0.0))[0] + 1
                wait = min(self.backoff_cap, self.backoff * 2.0 ** (failures - 1))
                self._effect_failures[reply_id] = (failures, now + wait)
                self._effect_failures.move_to_end(reply_id)
                while len(self._effect_failures) > FAILURES_KEPT:
                    self._effect_failures.popitem(last=False)
            elif status != "held":
                self._effect_failures.pop(reply_id, None)

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
            last_tries = self._last_tries(taken, [deliveries[index] for index in fresh])
            with self.metrics.commit_seconds.time():
                # last_tries only when some item is on its last try: a store of an
                # application's own written before dead letters still works until then.
                more = {"last_tries": last_tries} if last_tries else {}
                stored = (
                    self.store.accept_many(taken, self.effect, isolate=True, **more)
                    if taken
                    else Statuses()
                )
            self._count_failures(taken, stored)
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

    async def decide(self, deliveries: Sequence[Delivery]) -> list[Outcome]:
        """decide_now on a worker thread (the transaction blocks), then the before-ack point."""
        outcomes = await asyncio.to_thread(self.decide_now, deliveries)
        failpoints.hit(BEFORE_ACK)
        # Paused only when nothing was settled: a message that keeps failing must not
        # slow the other keys down, but a database that is down must not be hammered.
        settled = any(outcome not in REDELIVERED for outcome in outcomes)
        self._failures = 0 if settled else self._failures + 1
        return outcomes

    def retry_delay(self) -> float:
        """The pause before taking more messages: 0 unless the last batch is to be retried."""
        if self._failures == 0:
            return 0.0
        return min(self.backoff_cap, self.backoff * 2.0 ** (self._failures - 1))

    async def pause(self, seconds: float) -> None:
        """Wait `seconds`, or less when stop() is called meanwhile."""
        if seconds <= 0:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stop_event().wait(), seconds)

    async def wait_stopped(self) -> None:
        """Return once stop() has been called."""
        await self._stop_event().wait()

    async def unless_stopped(self, work: Awaitable[T]) -> T | None:
        """`work`'s result, or None when stop() comes first and `work` is cancelled.

        For waits with no end of their own, such as a client library's connect that
        retries an unreachable server for ever: a signal must still end the process.
        """
        task = asyncio.ensure_future(work)
        stopped = asyncio.ensure_future(self._stop_event().wait())
        try:
            await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            task.cancel()  # the caller was cancelled: the work must not run on alone
            raise
        finally:
            stopped.cancel()
        if task.done():
            return task.result()
        # Cancelled until it takes: on Python 3.11 a wait_for inside `work` (nats-py's
        # connect has some) can swallow a cancellation that lands as its wait ends, and
        # the client's retry loop then goes on as if nothing had happened.
        while not task.done():
            task.cancel()
            await asyncio.wait({task}, timeout=CANCEL_AGAIN)
        if task.cancelled():
            return None
        if task.exception() is not None:
            # Failed as the stop came (a client may turn the cancellation into its own
            # error): the stop is the answer, not the failure.
            log.debug("stopped while waiting: %r", task.exception())
            return None
        return task.result()  # it ended as the stop came: the caller closes what it holds


def _monotonic() -> float:
    """The clock of the key blocks (a test moves it)."""
    return time.monotonic()


def _shown(delivery: Delivery) -> str:
    """The message's id for a log line, cut short: it may be anything."""
    text = delivery.headers.get(ID_HEADER) or delivery.broker_id or "(none)"
    return text[:200]


def header_text(value: object) -> str | None:
    """A header value as text (AMQP tables may carry bytes); None for other types."""
    if isinstance(value, str):
        return value
    if isinstance(value, bytes | bytearray):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            return None
    return None


def lowercased(headers: Mapping[str, object] | None) -> dict[str, str]:
    """Header names lowercased, values as text; a value that is not text is left out."""
    result: dict[str, str] = {}
    for name, value in (headers or {}).items():
        text = header_text(value)
        if text is not None:
            result[name.lower()] = text
    return result
