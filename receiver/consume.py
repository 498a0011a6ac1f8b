"""Consume outbox messages from a broker with the receiver's dedupe: the broker-free core.

A broker consumer (receiver.nats_consumer, receiver.rabbitmq_consumer) hands each
batch of messages it fetched to ``Consumer.decide``, which checks every message
(``check``), stores the valid ones and runs the effect in ONE transaction
(``ReceiptStore.accept_many``), and returns an outcome per message. Only then does
the broker module settle each message:

- ``stored`` (first receipt, effect committed), ``duplicate`` (held with the same
  body: no second effect) and ``conflict`` (held with another body: logged as an
  error, nothing changed): acknowledged, never delivered again;
- ``invalid`` (a missing or malformed header, a signature that does not verify, a
  body whose SHA-256 differs from its ``outbox-content-hash`` header, a body that is
  not strict JSON): nothing stored, logged as an error, refused without requeue so the
  broker does not deliver it forever;
- ``retry`` (the store or the effect failed): nothing stored, not acknowledged; the
  broker delivers it again and the consumer pauses (doubling, capped) before it takes
  more, so a database that is down is not hammered.

The signature is verified without a freshness limit: a message may wait in the broker
for hours while its consumer is down, and a replayed message is only a duplicate.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Awaitable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, TypeVar

from outbox import failpoints
from outbox.canonical import sha256_hex
from outbox.errors import ConfigError, SignatureError, StoreUnavailable
from outbox.messages import is_reply_id
from outbox.signing import CONTENT_HASH_HEADER, ID_HEADER, SigningKey, parse_secret, verify
from receiver.effects import Effect
from receiver.metrics import ConsumerMetrics
from receiver.strict_json import InvalidJSON, check_strict_json

T = TypeVar("T")
CANCEL_AGAIN = 0.1
"""Seconds between cancellations of a wait that a stop ends (see unless_stopped)."""

Outcome = Literal["stored", "duplicate", "conflict", "invalid", "retry"]
ACKNOWLEDGED: frozenset[Outcome] = frozenset({"stored", "duplicate", "conflict"})
"""Outcomes the broker is told are done with: they are never delivered again."""

BEFORE_ACK = "receiver.consume.before_ack"
DEFAULT_BATCH = 100
DEFAULT_BACKOFF = 0.5
DEFAULT_BACKOFF_CAP = 30.0

log = logging.getLogger("outbox.receiver.consume")


class BatchStore(Protocol):
    """What a consumer needs from a receipt store: ReceiptStore.accept_many."""

    def accept_many(
        self, items: Sequence[tuple[str, bytes]], effect: Effect | None = None
    ) -> list[str]:
        """Store receipts in one transaction: stored, duplicate or conflict per item."""
        ...


@dataclass(frozen=True)
class Delivery:
    """One broker message: its headers (names lowercased), exact body, broker message id."""

    headers: Mapping[str, str]
    body: bytes
    broker_id: str | None = None


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
    if delivery.broker_id is not None and delivery.broker_id != reply_id:
        raise Invalid(f"the broker's message id differs from {ID_HEADER}")
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
    return reply_id


class Consumer:
    """The broker-free part of a consumer: decide on batches, pause after failures, stop."""

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
    ) -> None:
        """Verify with `secrets` (or nothing, unsigned=True); run `effect` per first receipt."""
        if batch < 1:
            raise ConfigError(f"batch must be >= 1, got {batch}")
        if not 0 < backoff <= backoff_cap:
            raise ConfigError("backoff must be > 0 and at most backoff_cap")
        self.store = store
        self.keys = signing_keys(secrets, unsigned)
        self.effect = effect
        self.batch = batch
        self.backoff = backoff
        self.backoff_cap = backoff_cap
        self.metrics = metrics or ConsumerMetrics()
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
        outcomes: list[Outcome] = ["invalid"] * len(deliveries)
        items: list[tuple[str, bytes]] = []
        positions: list[int] = []
        for index, delivery in enumerate(deliveries):
            try:
                reply_id = check(delivery, self.keys)
            except Invalid as exc:
                log.error(
                    "refused a broker message (not stored, not redelivered): %s",
                    exc,
                    extra={"fields": {"reply_id": _shown(delivery), "reason": str(exc)}},
                )
                continue
            items.append((reply_id, delivery.body))
            positions.append(index)
        if items:
            for index, status in zip(positions, self._store(items), strict=True):
                outcomes[index] = status
        for outcome in outcomes:
            self.metrics.consumed.labels(outcome).inc()
        return outcomes

    def _store(self, items: Sequence[tuple[str, bytes]]) -> list[Outcome]:
        try:
            with self.metrics.commit_seconds.time():
                statuses = self.store.accept_many(items, self.effect)
        except StoreUnavailable as exc:
            log.warning("receipt store unavailable; the messages will come again: %s", exc)
            return ["retry"] * len(items)
        except Exception:
            log.exception("storing %d message(s) failed; they will come again", len(items))
            return ["retry"] * len(items)
        outcomes: list[Outcome] = []
        for (reply_id, _), status in zip(items, statuses, strict=True):
            if status == "conflict":
                log.error(
                    "reply_id %s is held with another body: acknowledged, nothing changed",
                    reply_id,
                    extra={"fields": {"reply_id": reply_id}},
                )
                outcomes.append("conflict")
            elif status == "duplicate":
                outcomes.append("duplicate")
            else:
                outcomes.append("stored")
        return outcomes

    async def decide(self, deliveries: Sequence[Delivery]) -> list[Outcome]:
        """decide_now on a worker thread (the transaction blocks), then the before-ack point."""
        outcomes = await asyncio.to_thread(self.decide_now, deliveries)
        failpoints.hit(BEFORE_ACK)
        if "retry" in outcomes:
            self._failures += 1
        else:
            self._failures = 0
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
