"""A publisher without the secret takes a reply's old Nats-Msg-Id before the relay publishes
the reply: the real reply still enters the stream and is applied (relay and consumer real)."""

from __future__ import annotations

import asyncio
import json

import nats
from sqlalchemy.orm import Session
from support.broker_messages import Stream, consumed, outbox_headers, until
from support.receiver_helpers import SECRET, count_effects, stored_receipts
from test_consume_nats import WAIT, body_of, nats_consumer, running, settled

import outbox
from receiver import ReceiptStore
from relay import Relay, make_destination


def test_a_forged_msg_id_published_first_does_not_swallow_the_reply(
    db_url: str, nats_stream: Stream
) -> None:
    store = ReceiptStore(db_url)
    engine = outbox.create_engine(db_url)
    with Session(engine) as session, session.begin():
        outbox.publish(session, "default", "r-1", {"real": True})
    engine.dispose()
    destination = make_destination(
        nats_stream.url,
        kind="nats",
        stream=nats_stream.name,
        subject=f"{nats_stream.prefix}.{{ordering_key}}",
        secret=SECRET,
        timeout=5,
        allow_short_retention=True,  # the fixture's stream keeps JetStream's default window
    )

    async def attack() -> None:
        # Anyone who may publish on the subjects, without the secret: the reply's id as the
        # relay used to derive it (the reply_id), and a body of the attacker's choosing.
        forged = body_of("forged")
        headers = outbox_headers("r-1", forged, None)
        headers["Nats-Msg-Id"] = "r-1"
        client = await nats.connect(nats_stream.url)
        try:
            await client.jetstream().publish(f"{nats_stream.prefix}._", forged, headers=headers)
        finally:
            await client.close()

    asyncio.run(attack())
    with Relay(db_url, {"default": destination}) as relay:
        assert relay.dispatch_once() == [("r-1", "sent")]

    async def consume() -> None:
        consumer = nats_consumer(store, nats_stream)
        async with running(consumer):

            async def done() -> bool:
                return consumed(consumer.metrics, "stored") == 1 and await settled(nats_stream)

            await until(done, WAIT, "the real reply stored")
            assert consumed(consumer.metrics, "invalid") == 1  # the unsigned forgery

    try:
        asyncio.run(consume())
    finally:
        store.close()
    assert json.loads(stored_receipts(db_url)["r-1"]) == {"real": True}
    assert count_effects(db_url, "r-1") == 1
