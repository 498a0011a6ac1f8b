"""The least a receiver of relayed batches does: the bare relay's counterpart.

A raw ASGI callable under uvicorn (no framework): it parses the POSTed JSON
array of {reply_id, body} items, inserts them into its own table with one
statement (ON CONFLICT DO NOTHING, so a batch sent twice is stored once),
committed on its own, and answers 200 with no body. No signature, no size or time limits,
no per-item answer, no effect. Each receipt's time is taken from the database
as the reference receiver takes it, so commit-to-receipt reads the same way.
Run as a process:

    python -m benchmarks.bare_receiver DB_URL PORT
"""

from __future__ import annotations

import json
import sys
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import psycopg
import sqlalchemy as sa

metadata = sa.MetaData()

bare_receipts = sa.Table(
    "bare_receipts",
    metadata,
    sa.Column("reply_id", sa.String(200), primary_key=True),
    sa.Column("body", sa.Text(), nullable=False),
    sa.Column("received_at", sa.Double(), nullable=False),
)

INSERT_RECEIPTS = (
    "INSERT INTO bare_receipts (reply_id, body, received_at) "
    "SELECT t.reply_id, t.body, extract(epoch from statement_timestamp())::float8 "
    "FROM unnest(%s::varchar[], %s::text[]) AS t(reply_id, body) "
    "ON CONFLICT (reply_id) DO NOTHING"
)

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


def create_table(url: str) -> None:
    """Create bare_receipts in the database at `url` (a SQLAlchemy URL)."""
    engine = sa.create_engine(url)
    try:
        metadata.create_all(engine)
    finally:
        engine.dispose()


def conninfo(url: str) -> str:
    """A psycopg connection string for a SQLAlchemy URL."""
    return sa.make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


def application(db: str) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
    """The ASGI callable: GET answers 200 (health), POST stores a batch."""
    # One connection per request in flight, reused: each bare relay has one POST out.
    idle: list[psycopg.AsyncConnection[Any]] = []

    async def store(items: list[dict[str, str]]) -> None:
        # Autocommit: the one statement is its own transaction, committed in its round trip.
        conn = idle.pop() if idle else await psycopg.AsyncConnection.connect(db, autocommit=True)
        try:
            await conn.execute(
                INSERT_RECEIPTS,
                ([item["reply_id"] for item in items], [item["body"] for item in items]),
            )
        finally:
            idle.append(conn)

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        if scope["method"] == "POST":
            chunks = []
            more = True
            while more:
                message = await receive()
                chunks.append(message.get("body", b""))
                more = message.get("more_body", False)
            await store(json.loads(b"".join(chunks)))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    return app


def main() -> int:
    """Serve until SIGTERM."""
    import uvicorn

    db_url, port = sys.argv[1:3]
    uvicorn.run(
        application(conninfo(db_url)),
        host="127.0.0.1",
        port=int(port),
        log_level="warning",
        access_log=False,
        lifespan="off",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
