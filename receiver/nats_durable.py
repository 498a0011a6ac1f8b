"""The JetStream durable a NatsConsumer pulls from: made when missing, refused when it
cannot work as the consumer needs, and watched while it runs.

A durable can stop advancing for reasons no single fetch sees (its max_ack_pending
filled by messages nobody settles): every ``stall_after / 4`` seconds the durable is
read, its pending counts go to the metrics, and when it has work but neither its
acknowledgement floor moved nor the consumer settled anything for ``stall_after``
seconds, a warning is logged and ``outbox_receiver_durable_stalled`` is 1.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from outbox.errors import ConfigError
from receiver.metrics import ConsumerMetrics
from receiver.nats_package import nats_package
from receiver.stoppable import Stoppable

if TYPE_CHECKING:
    from nats.js.client import JetStreamContext

log = logging.getLogger("outbox.receiver.consume")


async def ensure_durable(
    jetstream: JetStreamContext, stream: str, durable: str, ack_wait: float
) -> None:
    """Create the durable consumer if missing; refuse one that cannot work as we need."""
    nats = nats_package()
    from nats.js.api import AckPolicy, ConsumerConfig

    try:
        await jetstream.stream_info(stream)
    except nats.js.errors.NotFoundError as exc:
        raise ConfigError(f"JetStream has no stream {stream!r}") from exc
    try:
        info = await jetstream.consumer_info(stream, durable)
    except nats.js.errors.NotFoundError:
        config = ConsumerConfig(
            durable_name=durable,
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=ack_wait,
        )
        await jetstream.add_consumer(stream, config=config)
        log.info("created durable consumer %s on stream %s", durable, stream)
        return
    if info.config.ack_policy != AckPolicy.EXPLICIT:
        raise ConfigError(f"durable consumer {durable!r} must use explicit acks")
    if info.config.deliver_subject:
        raise ConfigError(f"durable consumer {durable!r} is a push consumer; need pull")
    limit = info.config.max_deliver
    if limit is not None and limit > 0:
        # Every nak counts as a delivery, a held message's too: behind a message that
        # keeps failing, its key's later messages could reach the limit and JetStream
        # would stop delivering them, unapplied. --max-deliveries is the bound to use.
        log.warning(
            "durable consumer %s has max_deliver %d: JetStream stops delivering a message "
            "after %d deliveries, held ones included; create it without max_deliver and "
            "bound failing messages with --max-deliveries",
            durable,
            limit,
            limit,
            extra={"fields": {"durable": durable, "max_deliver": limit}},
        )


async def watch_durable(
    jetstream: JetStreamContext,
    *,
    stream: str,
    durable: str,
    stall_after: float,
    metrics: ConsumerMetrics,
    settled: Callable[[], int],
    stopper: Stoppable,
) -> None:
    """Read the durable every stall_after / 4 seconds: its pending counts to the metrics,
    and a warning when it has work but neither its floor moved nor `settled()` (the
    consumer's count of messages it settled) grew for stall_after seconds; until stopped."""
    nats = nats_package()
    floor: int | None = None
    progress = settled()
    since = time.monotonic()
    stalled = False
    while True:
        await stopper.pause(stall_after / 4)  # a stop ends it early
        if stopper.stopping:
            return
        try:
            info = await jetstream.consumer_info(stream, durable)
        except (nats.errors.Error, TimeoutError) as exc:
            log.debug("reading durable %s failed: %s", durable, exc)
            continue
        pending, ack_pending = info.num_pending or 0, info.num_ack_pending or 0
        metrics.durable_pending.set(pending)
        metrics.durable_ack_pending.set(ack_pending)
        now_floor = info.ack_floor.stream_seq if info.ack_floor else None
        now = time.monotonic()
        if pending + ack_pending == 0 or now_floor != floor or settled() != progress:
            since = now
            if stalled:
                stalled = False
                metrics.durable_stalled.set(0)
                log.info("durable %s advances again", durable)
        elif not stalled and now - since >= stall_after:
            stalled = True
            metrics.durable_stalled.set(1)
            log.warning(
                "durable %s on stream %s has not advanced for %.0f s: %d message(s) to "
                "deliver, %d delivered and unacknowledged (max_ack_pending %s)",
                durable,
                stream,
                now - since,
                pending,
                ack_pending,
                info.config.max_ack_pending,
                extra={"fields": {"stream": stream, "durable": durable}},
            )
        floor, progress = now_floor, settled()
