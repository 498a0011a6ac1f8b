"""Per-key order through a broker, relay to consumer: 50 keys x 20 messages.

Each message is published with an ordering key in its own transaction, in order
within each key; two relay processes deliver into the broker and one `outbox
receiver consume` process applies the reference effect. The effects table's
identity column is the order in which the consumer applied them: within each
key it must be the publish order, whatever the interleaving across keys.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

import outbox
from faults.brokers import Deployment, broker
from outbox.receiver_tables import effects

pytestmark = [
    pytest.mark.postgresql_only,
    pytest.mark.parametrize("backend", ["postgresql"], indirect=True),
]

KEYS = 50
PER_KEY = 20


@pytest.mark.parametrize("kind", ["nats", "rabbitmq"])
def test_each_keys_messages_are_applied_in_publish_order(
    kind: str, db_url: str, tmp_path: Path
) -> None:
    engine = outbox.create_engine(db_url)
    ids: list[str] = []
    try:
        for n in range(PER_KEY):
            for key in range(KEYS):
                reply_id = f"k{key}-{n}"
                with Session(engine) as session, session.begin():
                    outbox.publish(
                        session, "default", reply_id, {"n": n}, ordering_key=f"key-{key}"
                    )
                ids.append(reply_id)
    finally:
        engine.dispose()
    with broker(kind) as place, Deployment(tmp_path, db_url, place, batch=100) as deployment:
        consumer = deployment.consumer()
        deployment.relay()
        deployment.relay()
        deployment.drain(ids, timeout=120).assert_clean()
        assert consumer.stop() == 0, deployment.logs()
    engine = outbox.create_engine(db_url)
    try:
        with engine.connect() as conn:
            applied = conn.execute(sa.select(effects.c.reply_id).order_by(effects.c.id)).scalars()
            per_key: dict[str, list[int]] = defaultdict(list)
            for reply_id in applied:
                key, n = reply_id.split("-")
                per_key[key].append(int(n))
    finally:
        engine.dispose()
    assert len(per_key) == KEYS
    assert all(order == list(range(PER_KEY)) for order in per_key.values()), {
        key: order for key, order in per_key.items() if order != list(range(PER_KEY))
    }
