"""HTTP: Standard Webhooks POSTs to the destination's url, one per message or in batches.

Single mode sends each message as its own signed request; the status decides its
outcome. Batch mode sends many messages in one signed POST, each settled by the
per-item answer:

The body is `{"replies": [{"reply_id": str, "body": str, "ordering_key": str,
"headers": {...}}, ...]}`, each body the exact stored text of one message,
`ordering_key` and `headers` its own (each left out when it has none), and the
request signed with a `batch:` id; the answer is `{"results": [{"reply_id",
"status"}]}` with stored, duplicate, conflict, invalid, retry or held per item.

A batch holds at most one message of an ordering key, unless the destination sets
`ordered_batches`: its receiver then applies a key's items in order and answers
`held` for the items of a key after one it did not apply. The relay takes each item's
answer as given: an item answered stored was applied, and is sent even after an
earlier item of its key that was not (a resend would not undo it).
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from json.encoder import encode_basestring
from typing import Any, ClassVar, Literal
from urllib.parse import urlsplit, urlunsplit

try:
    import orjson
except ImportError:  # the `fast` extra is not installed: the items are encoded one by one
    orjson = None  # type: ignore[assignment]

from outbox.errors import ConfigError
from outbox.messages import BATCH_ID_PREFIX
from outbox.redaction import redact_urls, shown_value
from relay.destination import Destination, KindOptions, Reader, flag, text
from relay.errors import TransportError
from relay.http_client import HttpClient, Response
from relay.policy import Dead, Outcome, Retry, Sent, Unsent, classify, truncate
from relay.receipts import receipt_matches
from relay.records import Message, key_chains
from relay.transports.base import Parcel, Transport
from relay.webhooks import post, request_headers, snippet

_BATCH_HEAD = b'{"replies":['
_BATCH_TAIL = b"]}"
_COMPACT: dict[str, Any] = {"separators": (",", ":")}
"""json.dumps options that write what orjson.dumps writes of the ASCII headers publish() takes."""

Mode = Literal["single", "batch"]


@dataclass(frozen=True)
class HttpOptions(KindOptions):
    """What an HTTP destination has besides the common keys (docs/reference/config.md)."""

    KIND: ClassVar[str] = "http"
    URL_SCHEMES: ClassVar[tuple[str, ...]] = ("http", "https")
    KEYS: ClassVar[Mapping[str, Reader]] = {
        "mode": text,
        "receipt_lookup": flag,
        "batch_url": text,
        "ordered_batches": flag,
    }

    mode: Mode = "single"
    """One POST per message (single), or many messages per POST (batch)."""
    receipt_lookup: bool = False
    """GET <url>/<reply_id> settles an unknown outcome and guards requeues."""
    batch_url: str | None = None
    ordered_batches: bool = False
    """Batch mode: the receiver applies a batch's items of one ordering key in order and
    answers `held` after one it did not apply, so a batch may hold several of them."""

    def __post_init__(self) -> None:
        if self.mode not in ("single", "batch"):
            raise ConfigError(
                f"destination mode must be 'single' or 'batch', got {shown_value(self.mode)}"
            )

    def other_urls(self) -> tuple[str, ...]:
        """The batch endpoint, when it is configured."""
        return () if self.batch_url is None else (self.batch_url,)

    def asks_receipts(self) -> bool:
        """As receipt_lookup says."""
        return self.receipt_lookup

    def post_batch_url(self, url: str) -> str:
        """The batch endpoint: configured, or `<url>/batch` for the reference receiver."""
        return self.batch_url or url.rstrip("/") + "/batch"


class HttpTransport(Transport):
    """The common part of HTTP transports: one pooled client, receipt lookup, retention."""

    MESSAGING_SYSTEM = "webhook"
    RETENTION_HEADER = "outbox-receipt-retention"

    def __init__(self, destination: Destination) -> None:
        """One keep-alive client per destination, at most `concurrency` connections."""
        super().__init__(destination)
        options = destination.options
        if not isinstance(options, HttpOptions):
            raise ConfigError(f"an http destination has HttpOptions, not {options!r}")
        self.options = options
        self.client = HttpClient(destination.concurrency)

    @property
    def mode(self) -> str:
        """The label of this transport in metrics: single or batch."""
        return self.options.mode

    @functools.cached_property
    def post_url(self) -> str:
        """Where deliveries are POSTed."""
        return self.destination.url

    @functools.cached_property
    def _client_attributes(self) -> dict[str, str | int]:
        url = urlsplit(self.post_url)
        port = url.port or (443 if url.scheme == "https" else 80)
        return {
            "http.request.method": "POST",
            "server.address": url.hostname or "",
            "server.port": port,
            "url.full": redact_urls(self.post_url),
        }

    def span_attributes(self) -> dict[str, str | int]:
        """The HTTP client attributes: method, server, and the URL without credentials."""
        return self._client_attributes

    async def holds(self, message: Message) -> bool | None:
        """GET <url>/<reply_id> and compare the content hash."""
        return await receipt_matches(
            self.client, self.destination, message.reply_id, message.content_hash
        )

    async def retention(self) -> float | None:
        """The Outbox-Receipt-Retention header of the destination's /healthz, if any.

        Unreachable now is a delivery problem, retried like any other: the caller
        is told by TimeoutError or TransportError that it could not be checked.
        """
        health = health_url(self.destination.url)
        response = await self.client.request(
            "GET", health, headers={}, seconds=self.destination.timeout
        )
        if not 200 <= response.status < 300:
            raise TransportError(f"{redact_urls(health)} answered {response.status}")
        advertised = response.headers.get(self.RETENTION_HEADER)
        try:
            retention = float(advertised) if advertised is not None else math.nan
        except ValueError:
            retention = math.nan
        # Absent or unreadable (not a number, NaN, negative): published as none.
        return retention if math.isfinite(retention) and retention >= 0 else None

    async def close(self) -> None:
        """Close the pooled connections."""
        await self.client.close()


def health_url(url: str) -> str:
    """The /healthz next to a destination url: a sibling of its last path segment."""
    parts = urlsplit(url)
    path = parts.path.rstrip("/").rsplit("/", 1)[0] if "/" in parts.path.strip("/") else ""
    return urlunsplit((parts.scheme, parts.netloc, path + "/healthz", "", ""))


class HttpSingleTransport(HttpTransport):
    """Each message its own signed request; the status decides its outcome."""

    def parcels(self, messages: Sequence[Message]) -> list[Parcel]:
        """One parcel per message."""
        return [Parcel((message,)) for message in messages]

    async def send(self, parcel: Parcel) -> dict[int, Outcome]:
        """POST the message with its own headers and the signature headers."""
        (message,) = parcel.messages
        destination = self.destination
        headers = {
            **message.headers,
            **request_headers(destination, message.reply_id, message.body),
        }
        response = await post(self.client, destination, destination.url, headers, message.body)
        if isinstance(response, Retry):
            return {message.id: response}
        retry_after = response.headers.get("retry-after")
        return {message.id: classify(response.status, retry_after, snippet(response))}


def pack_batches(
    messages: Sequence[Message], max_items: int, max_bytes: int
) -> list[tuple[list[Message], bytes]]:
    """Split messages into batch bodies within the destination's item and byte limits."""
    if orjson is not None and 0 < len(messages) <= max_items:
        # The usual claim fits one batch: orjson encodes it whole in C, byte for byte the
        # body the items below make (its strings escaped as the standard library's).
        items = [
            {"reply_id": m.reply_id, "body": m.body.decode("utf-8")}
            if m.ordering_key is None and not m.headers
            else _item(m)
            for m in messages
        ]
        try:
            body = orjson.dumps({"replies": items})
        except orjson.JSONEncodeError:
            pass  # a string it refuses (a lone surrogate): the standard library escapes it
        else:
            if len(body) <= max_bytes:
                return [(list(messages), body)]
    return _packed_by_item(messages, max_items, max_bytes)


def _item(message: Message) -> dict[str, object]:
    """One message as its batch item, ordering key and headers included when it has them."""
    item: dict[str, object] = {"reply_id": message.reply_id, "body": message.body.decode("utf-8")}
    if message.ordering_key is not None:
        item["ordering_key"] = message.ordering_key
    if message.headers:
        item["headers"] = dict(message.headers)
    return item


def _packed_by_item(
    messages: Sequence[Message], max_items: int, max_bytes: int
) -> list[tuple[list[Message], bytes]]:
    """pack_batches item by item, each measured against the limits."""
    packed: list[tuple[list[Message], bytes]] = []
    group: list[Message] = []
    items: list[bytes] = []
    size = len(_BATCH_HEAD) + len(_BATCH_TAIL)
    for message in messages:
        # The body is canonical JSON text, carried as a JSON string; the C string encoder
        # is several times faster than dumping a dict per item.
        item = (
            '{"reply_id":'
            + encode_basestring(message.reply_id)
            + ',"body":'
            + encode_basestring(message.body.decode("utf-8"))
            + (
                ',"ordering_key":' + encode_basestring(message.ordering_key)
                if message.ordering_key is not None
                else ""
            )
            # A message's own headers (its traceparent among them) travel with it, as
            # they do as HTTP headers in single mode; compact, as orjson writes them.
            + (
                ',"headers":' + json.dumps(dict(message.headers), **_COMPACT)
                if message.headers
                else ""
            )
            + "}"
        ).encode()
        if group and (len(group) >= max_items or size + len(item) + 1 > max_bytes):
            packed.append((group, _BATCH_HEAD + b",".join(items) + _BATCH_TAIL))
            group, items, size = [], [], len(_BATCH_HEAD) + len(_BATCH_TAIL)
        group.append(message)
        items.append(item)
        size += len(item) + 1
    if group:
        packed.append((group, _BATCH_HEAD + b",".join(items) + _BATCH_TAIL))
    return packed


def one_per_key(messages: Sequence[Message]) -> list[Sequence[Message]]:
    """The messages in rounds: the first of each key (and every unkeyed one), then the
    second of each key, and so on."""
    chains = key_chains(messages)
    longest = max((len(chain) for chain in chains), default=0)
    if longest <= 1:
        return [messages]
    return [[chain[rank] for chain in chains if rank < len(chain)] for rank in range(longest)]


class HttpBatchTransport(HttpTransport):
    """Batches within max_batch_items and max_batch_bytes, POSTed to the batch url."""

    @functools.cached_property
    def post_url(self) -> str:
        """The batch url: where batches are POSTed."""
        return self.options.post_batch_url(self.destination.url)

    def parcels(self, messages: Sequence[Message]) -> list[Parcel]:
        """Messages packed into batch bodies; without ordered_batches, at most one message
        of a key per batch (a key's next one in a later batch, sent after it)."""
        destination = self.destination
        rounds = [messages] if self.options.ordered_batches else one_per_key(messages)
        return [
            Parcel(group, body)
            for part in rounds
            for group, body in pack_batches(
                part, destination.max_batch_items, destination.max_batch_bytes
            )
        ]

    async def send(self, parcel: Parcel) -> dict[int, Outcome]:
        """POST one batch; settle each message by the receiver's per-item answer."""
        batch, body = parcel.messages, parcel.body
        assert body is not None, "a batch parcel carries its body"
        destination = self.destination
        batch_id = f"{BATCH_ID_PREFIX}{batch[0].id}-{batch[-1].id}-{len(batch)}"
        headers = request_headers(destination, batch_id, body)
        response = await post(self.client, destination, self.post_url, headers, body)
        if isinstance(response, Retry):
            return dict.fromkeys((m.id for m in batch), response)
        whole = classify(response.status, response.headers.get("retry-after"), snippet(response))
        if isinstance(whole, Dead) and len(batch) > 1 and response.status in (400, 413):
            # The request as a whole was refused, not each message: a smaller batch may pass.
            whole = Retry(
                whole.status,
                truncate(f"{whole.error} (whole batch of {len(batch)} refused: lower max_batch_*)"),
            )
        if not isinstance(whole, Sent):
            return dict.fromkeys((m.id for m in batch), whole)
        return _per_item(response, batch)


HELD_BY_RECEIVER = Unsent(
    error="held by the destination: an earlier message of its ordering key in the batch "
    "was not applied"
)
"""An item the receiver did not apply because an earlier one of its key was not: pending
at once, its attempt given back."""


def _per_item(response: Response, batch: Sequence[Message]) -> dict[int, Outcome]:
    try:
        results = response.json()["results"]
        answers = {str(item["reply_id"]): str(item["status"]) for item in results}
        # A reply_id answered twice takes its last status, and any retry's error.
        errors: dict[str, Any] = {
            str(item["reply_id"]): item["error"]
            for item in results
            if item["status"] == "retry" and item.get("error") is not None
        }
    except (ValueError, KeyError, TypeError, AttributeError):
        bad = Retry(response.status, "batch answer is not the expected JSON")
        return dict.fromkeys((m.id for m in batch), bad)
    status = response.status
    # One outcome object per kind of answer: a batch's items mostly share one.
    by_answer: dict[str | None, Outcome] = {
        "stored": Sent(status),
        "duplicate": Sent(status),
        "conflict": Dead(409, "conflict: the destination holds this reply_id with another body"),
        "invalid": Dead(400, "invalid: the destination refused this body"),
        "retry": Retry(status, "the destination asked to retry this message"),
        "held": HELD_BY_RECEIVER,
    }
    omitted = Retry(status, "batch answer omits this message")
    outcomes = {
        message.id: by_answer.get(answers.get(message.reply_id), omitted) for message in batch
    }
    for message in batch if errors else ():
        said = errors.get(message.reply_id)
        if said is not None:
            outcomes[message.id] = Retry(
                status, truncate(f"the destination asked to retry this message: {said}")
            )
    if "held" not in answers.values():
        return outcomes  # nothing for the rule below to check
    return _held_only_behind_its_key(outcomes, batch, status)


def _held_only_behind_its_key(
    outcomes: dict[int, Outcome], batch: Sequence[Message], status: int
) -> dict[int, Outcome]:
    """`held` gives the attempt back, so it is taken only where the rule allows it: after
    an earlier item of its key in this batch that ended neither sent nor dead. Anywhere
    else it is a retry like any other, counted, so a receiver answering `held` to
    everything cannot keep a message pending for ever."""
    stopped: set[str] = set()
    for message in batch:
        outcome, key = outcomes[message.id], message.ordering_key
        if outcome is HELD_BY_RECEIVER and (key is None or key not in stopped):
            outcome = outcomes[message.id] = Retry(
                status, "held by the destination, with no earlier item of its key to wait for"
            )
        if key is not None and not isinstance(outcome, Sent | Dead):
            stopped.add(key)
    return outcomes


def http_transport(destination: Destination) -> Transport:
    """The HTTP transport of `destination`'s mode: batch, or single."""
    if isinstance(destination.options, HttpOptions) and destination.options.mode == "batch":
        return HttpBatchTransport(destination)
    return HttpSingleTransport(destination)
