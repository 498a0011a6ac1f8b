"""Dispatch: fan a claimed batch out to its destinations' transports, within limits.

Each destination has its transport and a concurrency limit. An attempt starts
only if it can end before the turn's lease deadline (else it is Unsent, its
attempt given back). Messages that may not be sent again (their budget spent)
are resolved by the destination's receipt lookup: a matching receipt means
sent, anything else dead with "outcome unknown".
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from functools import partial
from typing import NamedTuple

from outbox import failpoints, tracing
from outbox.durations import duration_text
from outbox.errors import ConfigError
from outbox.redaction import redact, redact_quoted
from relay.destination import Destination
from relay.errors import TransportError
from relay.metrics import RelayMetrics
from relay.policy import (
    HELD,
    NO_FAILURES,
    Dead,
    Outcome,
    Retry,
    Sent,
    Unsent,
    retains,
    truncate,
)
from relay.records import Message, chains_together, repeats_a_key
from relay.transports import transport_for
from relay.transports.base import Parcel, Transport

log = logging.getLogger("outbox.relay")


class Turn(NamedTuple):
    """A delivered turn to settle: its messages, their outcomes, the ids never attempted."""

    messages: list[Message]
    outcomes: dict[int, Outcome]
    """Each message's outcome, by message id."""
    unattempted: set[int]
    """Ids of messages whose delivery never started: their attempt is given back."""
    looked_up: frozenset[int] = frozenset()
    """Ids of messages only asked about by receipt lookup (spent before the turn): no
    delivery of theirs was attempted."""
    failures: Mapping[int, Retry | Dead] = NO_FAILURES
    """The answers of the attempts this turn made that did not deliver, by message id: what
    the settle records as failed attempts (a later receipt lookup may settle the message
    otherwise; the attempt and its answer stand)."""


class Dispatcher:
    """Delivers claimed messages through one transport per destination."""

    def __init__(
        self,
        destinations: Mapping[str, Destination],
        *,
        concurrency: int,
        max_attempts: int,
        metrics: RelayMetrics,
    ) -> None:
        """Transports are created on first use, on the loop that runs them."""
        self.destinations = destinations
        self.concurrency = concurrency
        self.max_attempts = max_attempts
        self.metrics = metrics
        self._transports: dict[str, Transport] = {}
        self._limits: dict[str, asyncio.Semaphore] = {}

    def transport(self, name: str) -> Transport:
        """The transport of destination `name`, with its concurrency limit."""
        transport = self._transports.get(name)
        if transport is None:
            destination = self.destinations[name]
            transport = transport_for(destination)
            self._transports[name] = transport
            self._limits[name] = asyncio.Semaphore(min(destination.concurrency, self.concurrency))
        return transport

    async def close(self) -> None:
        """Close every transport's connections."""
        for transport in self._transports.values():
            await transport.close()
        self._transports.clear()

    async def check_retention(self, window: Callable[[Destination], float]) -> None:
        """Refuse to run when a destination keeps receipts shorter than our retry window.

        Every destination is asked at once, each within its timeout. One that does
        not answer is a delivery problem, retried like any other (a warning), and its
        transport is told the window to check for once it can; one
        that publishes no retention is a warning too, or an error when its config
        sets `require_retention`.
        """
        names = list(self.destinations)
        answers = await asyncio.gather(
            *(self.transport(name).retention() for name in names), return_exceptions=True
        )
        for name, answer in zip(names, answers, strict=True):
            destination = self.destinations[name]
            longest = window(destination)
            if isinstance(answer, TimeoutError | TransportError):
                log.warning("destination %s: receipt retention not checked (%s)", name, answer)
                self.transport(name).check_retention_later(longest)
                continue
            if isinstance(answer, BaseException):
                raise answer
            if answer is None:
                why = (
                    f"destination {name!r} publishes no receipt retention: a resend up to "
                    f"{duration_text(longest)} after the first attempt could apply twice if it "
                    "forgets sooner"
                )
                if destination.require_retention:
                    raise ConfigError(f"{why} (require_retention is set)")
                log.warning("%s", why)
                continue
            if not retains(answer, longest):
                why = self.transport(name).too_short(name, answer, longest)
                if not destination.allow_short_retention:
                    raise ConfigError(why)
                log.warning("%s (allow_short_retention is set)", why)

    async def deliver_batch(
        self, deliver: list[Message], resolve: list[Message], deadline: float
    ) -> Turn:
        """Deliver one claimed batch and resolve what may not be sent; returns what to settle."""
        outcomes = await self._deliver(deliver, deadline)
        # Only answers of attempts made: a message of a destination this relay does not
        # know died unattempted.
        attempted = {m.id for m in deliver if m.destination in self.destinations}
        failures = {
            i: o for i, o in outcomes.items() if i in attempted and isinstance(o, Retry | Dead)
        }
        # Only a delivery that never started gives its attempt back; a later lookup that
        # ran out of lease time does not (the attempt was made).
        unattempted = {i for i, outcome in outcomes.items() if isinstance(outcome, Unsent)}
        outcomes.update(await self._resolve(resolve, "lease expired while sending", deadline))
        spent = [
            m
            for m in deliver
            if isinstance(outcomes[m.id], Retry) and m.attempts >= self.max_attempts
        ]
        if spent:
            outcomes.update(
                await self._resolve(spent, "retry budget exhausted", deadline, outcomes)
            )
        failpoints.hit("relay.after_remote_commit")
        looked_up = frozenset(m.id for m in resolve)
        return Turn(deliver + resolve, outcomes, unattempted, looked_up, failures)

    async def _deliver(self, messages: Sequence[Message], deadline: float) -> dict[int, Outcome]:
        outcomes: dict[int, Outcome] = {}
        by_destination: dict[str, list[Message]] = defaultdict(list)
        for message in messages:
            if message.destination in self.destinations:
                by_destination[message.destination].append(message)
            else:
                outcomes[message.id] = Dead(
                    None,
                    f"unknown destination {message.destination!r}: not in relay configuration",
                    of_destination=True,
                )
        jobs: list[Awaitable[dict[int, Outcome]]] = []
        for name, group in by_destination.items():
            transport = self.transport(name)
            if repeats_a_key(group):
                jobs.append(self._in_key_order(name, transport, group, deadline))
                continue
            jobs.extend(
                self._limited(name, parcel.messages, partial(_sent, transport, parcel), deadline)
                for parcel in transport.parcels(group)
            )
        for result in await asyncio.gather(*jobs):
            outcomes.update(result)
        return outcomes

    async def _in_key_order(
        self, name: str, transport: Transport, group: Sequence[Message], deadline: float
    ) -> dict[int, Outcome]:
        """Deliver a destination's part that holds several messages of some key.

        A parcel goes only once every earlier parcel holding one of its keys has ended;
        its messages of a key stopped by then (an earlier message of the key ended
        neither sent nor dead) are held back. Parcels that share no key still go at once,
        each under the destination's concurrency limit. Within a parcel, the transport
        keeps a key's messages in order (see Transport.parcels).
        """
        outcomes: dict[int, Outcome] = {}
        stopped: set[str] = set()
        last: dict[str, asyncio.Future[None]] = {}
        jobs: list[asyncio.Future[None]] = []
        for parcel in transport.parcels(chains_together(group)):
            keys = {m.ordering_key for m in parcel.messages if m.ordering_key is not None}
            before = {last[key] for key in keys if key in last}
            job = asyncio.ensure_future(
                self._after(name, transport, parcel, before, stopped, outcomes, deadline)
            )
            last.update(dict.fromkeys(keys, job))
            jobs.append(job)
        await asyncio.gather(*jobs)
        return outcomes

    async def _after(
        self,
        name: str,
        transport: Transport,
        parcel: Parcel,
        before: set[asyncio.Future[None]],
        stopped: set[str],
        outcomes: dict[int, Outcome],
        deadline: float,
    ) -> None:
        """Send one parcel of _in_key_order once the parcels `before` it have ended."""
        if before:
            await asyncio.wait(before)
        going = [m for m in parcel.messages if m.ordering_key not in stopped]
        for message in parcel.messages:
            if message.ordering_key in stopped:
                outcomes[message.id] = HELD
        # What is left of a parcel fits the limits the whole did; a transport may still
        # pack it in several parcels, which then go one after another.
        if not going:
            return  # every key of the parcel stopped: its messages are all held
        parts = [parcel] if len(going) == len(parcel.messages) else transport.parcels(going)
        for part in parts:
            sent = partial(_sent, transport, part)
            outcomes.update(await self._limited(name, part.messages, sent, deadline))
        for message in parcel.messages:
            # One that went dead releases its key: the key's later messages go on.
            if message.ordering_key is not None and not isinstance(
                outcomes[message.id], Sent | Dead
            ):
                stopped.add(message.ordering_key)

    async def _limited(
        self,
        name: str,
        messages: Sequence[Message],
        attempt: Callable[[], Awaitable[dict[int, Outcome]]],
        deadline: float,
    ) -> dict[int, Outcome]:
        """Run one request under the destination's concurrency limit, if the lease allows it."""
        transport = self.transport(name)
        async with self._limits[name]:
            if time.monotonic() + transport.destination.timeout > deadline:
                return dict.fromkeys((m.id for m in messages), Unsent())
            started = time.monotonic()
            try:
                return await attempt()
            finally:
                elapsed = time.monotonic() - started
                self.metrics.latency.labels(name, transport.mode).observe(elapsed)

    async def _resolve(
        self,
        messages: Sequence[Message],
        why: str,
        deadline: float,
        last: Mapping[int, Outcome] | None = None,
    ) -> dict[int, Outcome]:
        """Settle messages that may not be sent again: a matching receipt means sent, else dead."""
        jobs: list[Awaitable[dict[int, Outcome]]] = []
        for message in messages:
            destination = self.destinations.get(message.destination)
            if destination is not None and destination.receipt_lookup:
                held = partial(_held_outcome, self.transport(message.destination), message)
                jobs.append(self._limited(message.destination, [message], held, deadline))
        # A lookup answers Sent, nothing (no matching receipt), or Unsent (no lease time left).
        answered: dict[int, Outcome] = {}
        for result in await asyncio.gather(*jobs):
            answered.update(result)
        outcomes: dict[int, Outcome] = {}
        for message in messages:
            if message.id in answered:
                outcomes[message.id] = answered[message.id]
                continue
            previous = last.get(message.id) if last else None
            tail = f"; last: {previous.error}" if isinstance(previous, Retry | Dead) else ""
            status = previous.status if isinstance(previous, Retry | Dead) else None
            # Its attempts were spent on failures worth retrying: the destination's.
            unknown = truncate(f"outcome unknown: {why}{tail}")
            outcomes[message.id] = Dead(status, unknown, of_destination=True)
        return outcomes


async def _sent(transport: Transport, parcel: Parcel) -> dict[int, Outcome]:
    """One outcome for each message of the parcel, in a `send` span when tracing is set up."""
    if not tracing.configured():
        return await _answered(transport, parcel)
    messages = parcel.messages
    destination = messages[0].destination
    attributes: dict[str, str | int] = {
        "messaging.system": transport.MESSAGING_SYSTEM,
        "messaging.operation.type": "send",
        "messaging.operation.name": "send",
        "messaging.destination.name": destination,
        **transport.span_attributes(),
    }
    if len(messages) == 1:
        attributes["messaging.message.id"] = messages[0].reply_id
    else:
        attributes["messaging.batch.message_count"] = len(messages)
    contexts = [m.headers for m in messages]
    with tracing.operation(f"send {destination}", tracing.PRODUCER, attributes, contexts) as span:
        answers = await _answered(transport, parcel)
        failed = next((o for o in answers.values() if isinstance(o, Retry | Dead)), None)
        if failed is not None:
            # A batch's item to retry carries the batch's 2xx: no error's type.
            status = failed.status
            failing = status is not None and status >= 300
            span.fail(str(status) if failing else type(failed).__name__.lower(), failed.error)
    return answers


async def _answered(transport: Transport, parcel: Parcel) -> dict[int, Outcome]:
    """One outcome for each message of the parcel, whatever the destination answered.

    Nothing a destination sends may raise out of delivery: the turn's other outcomes
    would be lost with it. A transport that fails to read an answer, or leaves a
    message out, has met a bad answer, which is worth another try.
    """
    try:
        outcomes = await transport.send(parcel)
    except Exception as exc:  # any fault here is the answer's, see above
        hidden = redact_quoted(str(exc), transport.destination.credentials)
        log.warning(
            "destination %s: unreadable answer (%s: %s); retrying its %d messages",
            redact(transport.destination.url),
            type(exc).__name__,
            hidden,
            len(parcel.messages),
            # A traceback may quote what the message hides: only when debugging.
            exc_info=log.isEnabledFor(logging.DEBUG),
        )
        bad = Retry(None, truncate(f"unreadable answer: {type(exc).__name__}: {hidden}"))
        return dict.fromkeys((m.id for m in parcel.messages), bad)
    missing = Retry(None, "the transport gave this message no outcome")
    # A refused batch shares one outcome among all its messages: cleared once.
    cleared: dict[int, Outcome] = {}
    answers: dict[int, Outcome] = {}
    for message in parcel.messages:
        outcome = outcomes.get(message.id, missing)
        if id(outcome) not in cleared:
            cleared[id(outcome)] = _quoting_nothing(outcome, transport.destination)
        answers[message.id] = cleared[id(outcome)]
    return answers


def _quoting_nothing(outcome: Outcome, destination: Destination) -> Outcome:
    """`outcome` with its error cleared of the destination's credentials: an answer may
    echo the request's URL, token and all, and the error is stored, logged and shown."""
    if isinstance(outcome, Retry | Dead):
        return dataclasses.replace(
            outcome, error=redact_quoted(outcome.error, destination.credentials)
        )
    return outcome


async def _held_outcome(transport: Transport, message: Message) -> dict[int, Outcome]:
    try:
        found = await transport.holds(message)
    except Exception:  # an unreadable lookup answer is no answer
        log.warning(
            "receipt lookup of %s: unreadable answer",
            message.reply_id,
            exc_info=log.isEnabledFor(logging.DEBUG),
        )
        found = None
    return {message.id: Sent(None)} if found else {}
