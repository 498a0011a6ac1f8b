"""The receipt lookup: ask a destination whether it holds a message (GET <url>/<reply_id>)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Literal

from relay.destination import Destination
from relay.errors import TransportError
from relay.http_client import HttpClient
from relay.webhooks import request_headers

Receipt = Literal["held", "other body", "absent"]
"""What a destination's receipt lookup says of a message; None when it did not answer."""


async def receipt_matches(
    client: HttpClient, destination: Destination, reply_id: str, content_hash: str
) -> bool | None:
    """Ask the destination whether it holds this exact message: True, False, or None (unknown)."""
    answer = await lookup_receipt(client, destination, reply_id, content_hash)
    return None if answer is None else answer == "held"


async def lookup_receipt(
    client: HttpClient, destination: Destination, reply_id: str, content_hash: str
) -> Receipt | None:
    """The destination's receipt of `reply_id`: this body, another body, none; None: no answer."""
    headers = request_headers(destination, reply_id, b"")
    url = destination.lookup_url(reply_id)
    try:
        response = await client.request("GET", url, headers=headers, seconds=destination.timeout)
    except (TimeoutError, TransportError):
        return None
    if response.status == 404:
        return "absent"
    if response.status != 200:
        return None
    try:
        held = response.json().get("content_hash")
    except (ValueError, AttributeError):
        return None
    if not isinstance(held, str):
        return None  # a 200 that names no hash says nothing about which body is held
    return "held" if held == content_hash else "other body"


def ask_receipt(destination: Destination, reply_id: str, content_hash: str) -> Receipt | None:
    """lookup_receipt for command-line tools: blocking, on a client of its own."""
    return ask_receipts(destination, [(reply_id, content_hash)])[0]


def ask_receipts(
    destination: Destination, messages: Sequence[tuple[str, str]]
) -> list[Receipt | None]:
    """The receipts of many (reply_id, content_hash), asked on one client, `concurrency`
    at a time (blocking; for command-line tools)."""

    async def ask_all() -> list[Receipt | None]:
        client = HttpClient(destination.concurrency)
        limit = asyncio.Semaphore(destination.concurrency)

        async def ask(reply_id: str, content_hash: str) -> Receipt | None:
            async with limit:
                return await lookup_receipt(client, destination, reply_id, content_hash)

        try:
            return list(await asyncio.gather(*(ask(r, h) for r, h in messages)))
        finally:
            await client.close()

    return asyncio.run(ask_all())
