"""The JetStream consumer against publishers who set what nats-py reads as a server status,
and a durable that stops advancing."""

from __future__ import annotations

import asyncio
import logging

import nats
import pytest
from nats.js.api import AckPolicy, ConsumerConfig
from support.broker_messages import Stream, consumed, until
from support.receiver_helpers import count_effects, stored_receipts
from test_consume_nats import (
    WAIT,
    consumer_state,
    nats_consumer,
    publish,
    running,
    settled,
)

from receiver import ReceiptStore


async def raw_publish(url: str, subject: str, header_block: bytes, body: bytes) -> None:
    """Publish with a header block exactly as given (an inline status line, say), which
    nats-py's publish cannot write: HPUB on a socket of our own, then PING for the PONG."""
    host, port = url.removeprefix("nats://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        await reader.readline()  # INFO
        writer.write(b'CONNECT {"verbose":false,"pedantic":false,"headers":true}\r\n')
        size = len(header_block)
        writer.write(f"HPUB {subject} {size} {size + len(body)}\r\n".encode())
        writer.write(header_block + body + b"\r\nPING\r\n")
        await writer.drain()
        answer = await asyncio.wait_for(reader.readline(), WAIT)
        assert answer == b"PONG\r\n", answer  # an -ERR would say the server refused it
    finally:
        writer.close()
        await writer.wait_closed()


async def publish_headers(stream: Stream, headers: dict[str, str], body: bytes) -> None:
    """Publish with nats-py as anyone allowed to publish on the stream's subjects could."""
    client = await nats.connect(stream.url)
    try:
        await client.jetstream().publish(f"{stream.prefix}.x", body, headers=headers)
    finally:
        await client.close()


STATUS_BLOCKS = [
    # The classic control messages' header blocks, stored in the stream as messages.
    b"NATS/1.0 404\r\n\r\n",
    b"NATS/1.0 408 Request Timeout\r\n\r\n",
    b"NATS/1.0 100 Idle Heartbeat\r\n\r\n",
    b"NATS/1.0 409 Consumer Deleted\r\nwebhook-id: inline\r\n\r\n",
]


def test_messages_a_client_would_read_as_server_status_are_refused_and_the_rest_applied(
    db_url: str, nats_stream: Stream, caplog: pytest.LogCaptureFixture
) -> None:
    store = ReceiptStore(db_url)
    valid = [f"ok-{n}" for n in range(5)]

    async def scenario() -> int:
        bad = 0
        # nats-py's fetch fails with KeyError on the first and drops the others unsettled.
        for headers in (
            {"Status": "500"},
            {"Status": "408"},
            {"Status": "404", "Description": "No Messages"},
            {"Status": "100", "Description": "Idle Heartbeat"},
        ):
            await publish_headers(nats_stream, headers, b"")
            bad += 1
        # Signed with the real secret and whole, but carrying a Status header: an ordinary
        # message all the same, applied.
        await publish(nats_stream, "status-signed", spoil=lambda h: h.update(Status="503"))
        for block in STATUS_BLOCKS:
            await raw_publish(nats_stream.url, f"{nats_stream.prefix}.x", block, b"")
            await raw_publish(nats_stream.url, f"{nats_stream.prefix}.x", block, b"{}")
            bad += 2
        for reply_id in valid:
            await publish(nats_stream, reply_id)
        consumer = nats_consumer(store, nats_stream, batch=4)
        async with running(consumer):

            async def done() -> bool:
                return consumed(consumer.metrics, "stored") == len(valid) + 1 and await settled(
                    nats_stream
                )

            await until(done, WAIT, "the valid messages stored, everything settled")
            assert consumed(consumer.metrics, "invalid") == bad
            assert (await consumer_state(nats_stream)).num_redelivered == 0
        return bad

    with caplog.at_level(logging.ERROR, "outbox.receiver.consume"):
        try:
            asyncio.run(scenario())
        finally:
            store.close()
    # A Status header says nothing about the message: signed and whole, it is applied.
    assert sorted(stored_receipts(db_url)) == sorted([*valid, "status-signed"])
    for reply_id in valid:
        assert count_effects(db_url, reply_id) == 1


def test_a_durable_that_stops_advancing_is_reported_and_cleared(
    db_url: str, nats_stream: Stream, caplog: pytest.LogCaptureFixture
) -> None:
    store = ReceiptStore(db_url)

    async def scenario() -> None:
        client = await nats.connect(nats_stream.url)
        try:
            jetstream = client.jetstream()
            # Two messages taken by a consumer that never settles them fill max_ack_pending:
            # JetStream delivers nothing more until they time out (an hour here).
            await jetstream.add_consumer(
                nats_stream.name,
                ConsumerConfig(
                    durable_name=nats_stream.durable,
                    ack_policy=AckPolicy.EXPLICIT,
                    ack_wait=3600,
                    max_ack_pending=2,
                ),
            )
            for reply_id in ("lost-1", "lost-2", "a", "b", "c"):
                await publish(nats_stream, reply_id)
            thief = await jetstream.pull_subscribe_bind(nats_stream.durable, nats_stream.name)
            taken = await thief.fetch(2, timeout=WAIT)
            consumer = nats_consumer(store, nats_stream, stall_after=0.8)
            metrics = consumer.metrics

            def gauge(name: str) -> float:
                return metrics.registry.get_sample_value(name) or 0.0

            async with running(consumer):

                async def stalled() -> bool:
                    return gauge("outbox_receiver_durable_stalled") == 1

                await until(stalled, WAIT, "the stall reported")
                assert gauge("outbox_receiver_durable_pending") == 3
                assert gauge("outbox_receiver_durable_ack_pending") == 2
                assert consumed(metrics, "stored") == 0
                for message in taken:
                    await message.term()

                async def advancing() -> bool:
                    return (
                        consumed(metrics, "stored") == 3
                        and gauge("outbox_receiver_durable_stalled") == 0
                    )

                await until(advancing, WAIT, "the stall cleared once the durable advances")
        finally:
            await client.close()

    with caplog.at_level(logging.INFO, "outbox.receiver.consume"):
        try:
            asyncio.run(scenario())
        finally:
            store.close()
    said = [r.getMessage() for r in caplog.records]
    assert any("has not advanced" in text and r"max_ack_pending 2" in text for text in said)
    assert any("advances again" in text for text in said)
