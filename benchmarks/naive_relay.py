"""The hand-written outbox loop most services start with: the baseline the relay is held to.

One row per transaction, one POST per message on a new connection, and a
one-second sleep when nothing is pending. Signed like the real relay, so the
reference receiver accepts it; run as a process:

    python -m benchmarks.naive_relay DB_URL TARGET_URL SECRET

It prints `ready` once connected, so it is timed from there, as our relays are
from their readiness check, not from its interpreter's start.
"""

from __future__ import annotations

import http.client
import sys
import threading
import urllib.parse

import sqlalchemy as sa

import outbox
from outbox.schema import messages
from outbox.signing import sign

POLL_SECONDS = 1.0


def run(db_url: str, target: str, secret: str, stop: threading.Event) -> int:
    """Say `ready` once connected, then deliver until `stop` is set; returns how many
    messages were sent."""
    engine = outbox.create_engine(db_url)
    address = urllib.parse.urlsplit(target)
    sent = 0
    try:
        with engine.connect():
            pass  # the pool's connection made before the clock starts
        print("ready", flush=True)
        while not stop.is_set():
            with engine.begin() as conn:
                row = conn.execute(
                    sa.select(messages.c.id, messages.c.reply_id, messages.c.body)
                    .where(messages.c.state == "pending")
                    .order_by(messages.c.id)
                    .limit(1)
                    .with_for_update(skip_locked=True)
                ).first()
                if row is not None:
                    body = bytes(row.body)
                    headers = {"content-type": "application/json"}
                    headers.update(sign(secret, row.reply_id, None, body))
                    # A new connection per message, as such loops do (but no client object
                    # to build each time, which would make this baseline slower still).
                    connection = http.client.HTTPConnection(address.netloc, timeout=10)
                    try:
                        connection.request("POST", address.path, body=body, headers=headers)
                        status = connection.getresponse().status
                    finally:
                        connection.close()
                    if 200 <= status < 300:
                        conn.execute(
                            messages.update()
                            .where(messages.c.id == row.id)
                            .values(state="sent", attempts=messages.c.attempts + 1)
                        )
                        sent += 1
            if row is None:
                stop.wait(POLL_SECONDS)
    finally:
        engine.dispose()
    return sent


def main() -> int:
    """Run until SIGTERM (the default handler ends the process)."""
    db_url, target, secret = sys.argv[1:4]
    run(db_url, target, secret, threading.Event())
    return 0


if __name__ == "__main__":
    sys.exit(main())
