"""Publish, relay, receive on SQLite: each reply arrives once, with its exact bytes, at the
installed `outbox receiver` (its HTTP server and whichever protocol this install has)."""

from __future__ import annotations

import base64
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path

import httpx
import sqlalchemy as sa
from package_helpers import free_port, wait_until
from sqlalchemy.orm import Session

import outbox
import receiver
from outbox.receiver_tables import effects, receipts
from outbox.schema import messages
from relay import Relay, make_destination

SECRET = "whsec_" + base64.b64encode(b"package-test-secret-32-bytes-abc").decode()
Start = Callable[[Sequence[str]], subprocess.Popen[bytes]]


def answers(base: str, child: subprocess.Popen[bytes]) -> bool:
    """Whether the receiver's health check answers; fails at once if the process died."""
    if child.poll() is not None:
        output = child.communicate()[0].decode(errors="replace")
        raise AssertionError(f"outbox receiver exited with {child.returncode}: {output}")
    try:
        return httpx.get(base + "/healthz", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


def test_published_replies_arrive_once_with_their_exact_bytes(
    tmp_path: Path, process: Start
) -> None:
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    outbox.upgrade(url)
    receiver.upgrade(url)
    secrets = tmp_path / "secrets"
    secrets.write_text(SECRET + "\n", encoding="utf-8")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    child = process(["receiver", "--db", url, "--port", str(port), "--secret-file", str(secrets)])
    # Generous: answers() fails at once if the receiver exits, so only a machine too busy to
    # start it sooner ever waits long.
    wait_until(lambda: answers(base, child), 180, "`outbox receiver` to answer /healthz")

    ids = [f"order-{n}:confirmed" for n in range(5)]
    engine = outbox.create_engine(url)
    try:
        for n, reply_id in enumerate(ids):
            with Session(engine) as session, session.begin():
                outbox.publish(session, "billing", reply_id, {"order": n, "text": "é <&>"})
        target = {
            "billing": make_destination(base + "/replies", secret=SECRET, receipt_lookup=True)
        }
        verdicts: list[tuple[str, str]] = []
        with Relay(url, target) as relay:
            while turn := relay.dispatch_once():
                verdicts.extend(turn)
        assert sorted(verdicts) == [(reply_id, "sent") for reply_id in sorted(ids)]
        with engine.connect() as conn:
            sent = dict(conn.execute(sa.select(messages.c.reply_id, messages.c.body)).all())
            held = dict(conn.execute(sa.select(receipts.c.reply_id, receipts.c.body)).all())
            applied = conn.execute(sa.select(effects.c.reply_id)).scalars().all()
    finally:
        engine.dispose()
    assert {reply_id: bytes(body) for reply_id, body in held.items()} == {
        reply_id: bytes(body) for reply_id, body in sent.items()
    }
    assert sorted(applied) == sorted(ids)
