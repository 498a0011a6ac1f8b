"""Receive outbox-relay deliveries in your own FastAPI service (single mode).

The wire contract is docs/reference/receiver-contract.md; this app keeps it with the
library's two receiver helpers, `receiver.verify` and `receiver.ReceiptStore`:

- POST /replies verifies the signature, refuses a body that is not JSON, and
  stores the receipt and your effect in one transaction, once per reply_id.
- GET /replies/{reply_id} is the receipt lookup the relay asks when it cannot
  know whether a delivery arrived.
- GET /healthz publishes how long receipts are kept, which the relay checks at
  start.

Run it (the receiver tables come from `outbox receiver upgrade --db URL`):

    RECEIVER_DB=postgresql://app@db/app RECEIVER_SECRETS=whsec_... \\
        uvicorn --factory examples.fastapi_receiver:from_environment --port 8000

and give the relay a destination with url = "http://HOST:8000/replies" and
receipt_lookup = true.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from sqlalchemy.orm import Session

from outbox.errors import PayloadCollision, SignatureError
from outbox.signing import DEFAULT_TOLERANCE, parse_secret
from receiver import ReceiptStore, StoreUnavailable, is_reply_id, verify
from receiver.effects import REPLY_ID_KEY

# Relay bodies stay far below this (64 KiB published, 256 KiB task results); refusing
# more before buffering it keeps anyone from filling memory before the signature check.
MAX_BODY = 1_048_576
RETENTION_HEADER = "Outbox-Receipt-Retention"

# Your own table, standing for whatever a delivery changes in your service. It has no
# unique key on reply_id on purpose: the receipt, committed in the same transaction,
# is what makes the insert below happen once per reply_id.
metadata = sa.MetaData()
applied = sa.Table(
    "example_applied",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("reply_id", sa.String(200), nullable=False),
    sa.Column("body", sa.Text, nullable=False),
)


def apply(session: Session, body: bytes) -> None:
    """The effect: runs for a first receipt only, inside the transaction that stores it."""
    # Any error here rolls the receipt back too, and the 500 makes the relay try again.
    reply_id = session.info[REPLY_ID_KEY]
    session.execute(sa.insert(applied).values(reply_id=reply_id, body=body.decode("utf-8")))


def open_store(db_url: str) -> ReceiptStore:
    """A ReceiptStore on `db_url` (upgraded with `outbox receiver upgrade`), with our table."""
    store = ReceiptStore(db_url)
    metadata.create_all(store.engine)  # a real service has its own migrations for this
    return store


def _answer(
    status: int, document: dict[str, Any], headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(document, status_code=status, headers=headers)


def _unavailable() -> JSONResponse:
    """A temporary failure: 503, which the relay retries; a 4xx would make the message dead."""
    return _answer(503, {"error": "receipt store unavailable, retry"}, {"Retry-After": "1"})


async def _read_body(request: Request, limit: int) -> bytes | None:
    """The exact body bytes, or None as soon as they pass `limit`."""
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            return None
    return bytes(body)


def create_app(
    store: ReceiptStore, secrets: Sequence[str], tolerance: float = DEFAULT_TOLERANCE
) -> FastAPI:
    """The receiver: POST /replies, GET /replies/{reply_id}, GET /healthz."""
    if isinstance(secrets, str) or not secrets:
        raise ValueError("secrets must be a non-empty list of whsec_ secrets")
    for secret in secrets:
        parse_secret(secret)  # a malformed secret fails here, not as a 500 per delivery
    # The relay refuses (or warns) at start unless receipts outlive its resends.
    retention = {RETENTION_HEADER: str(int(store.retention))}
    app = FastAPI(openapi_url=None)  # nothing to browse on a webhook endpoint

    @app.post("/replies")
    async def deliver(request: Request) -> JSONResponse:
        """One message: verify, dedupe and apply it, and say whether it was stored."""
        # Read the raw bytes: the signature and the dedupe hash cover exactly these, not
        # a parsed and re-serialized copy.
        body = await _read_body(request, MAX_BODY)
        if body is None:
            return _answer(413, {"error": f"body larger than {MAX_BODY} bytes"})
        try:
            reply_id = verify(request.headers, body, secrets, tolerance)
        except SignatureError as exc:
            return _answer(401, {"error": str(exc)})
        if not is_reply_id(reply_id):
            # A batch request's id (batch:...): signed for another endpoint, so a captured
            # batch replayed here must not be stored as one message.
            return _answer(400, {"error": "webhook-id is not a reply_id"})
        try:
            json.loads(body.decode("utf-8"))
        except (ValueError, RecursionError):  # not UTF-8, not JSON, or nested too deep
            # Refused before anything is stored: a 4xx must mean nothing was applied.
            return _answer(400, {"error": "body is not UTF-8 JSON"})
        try:
            # The store is synchronous (SQLAlchemy): keep it off the event loop.
            receipt = await run_in_threadpool(store.accept, reply_id, body, apply)
        except PayloadCollision:
            return _answer(409, {"error": f"{reply_id!r} was stored with a different body"})
        except StoreUnavailable:
            return _unavailable()
        # 2xx only now that the receipt is committed: the relay never sends it again.
        return _answer(200, {"ack": "stored", "reply_id": reply_id, "duplicate": receipt.duplicate})

    # `path`: a reply_id may hold '/', which arrives percent-encoded and decoded here.
    @app.get("/replies/{reply_id:path}")
    async def lookup(reply_id: str, request: Request) -> JSONResponse:
        """Whether we hold `reply_id`, and the hash of the body we hold."""
        # Signed like a delivery with an empty body, so only the relay can probe receipts.
        try:
            signed_id = verify(request.headers, b"", secrets, tolerance)
        except SignatureError as exc:
            return _answer(401, {"error": str(exc)})
        if signed_id != reply_id:
            return _answer(401, {"error": "webhook-id does not name the requested message"})
        try:
            receipt = await run_in_threadpool(store.lookup, reply_id)
        except StoreUnavailable:
            return _unavailable()
        if receipt is None:
            return _answer(404, {"error": "no receipt (never received, or purged)"})
        document = {
            "reply_id": receipt.reply_id,
            "content_hash": receipt.content_hash,
            "received_at": receipt.received_at,
        }
        return _answer(200, document)

    @app.get("/healthz")
    async def healthz() -> JSONResponse:
        """Up, and how many seconds receipts are kept."""
        return _answer(200, {"status": "ok"}, retention)

    return app


def from_environment() -> FastAPI:
    """The app for `uvicorn --factory`: RECEIVER_DB, RECEIVER_SECRETS (comma-separated)."""
    secrets = [s.strip() for s in os.environ["RECEIVER_SECRETS"].split(",") if s.strip()]
    return create_app(open_store(os.environ["RECEIVER_DB"]), secrets)
