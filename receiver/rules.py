"""What the receiver answers, decided without any HTTP framework: the shells only do I/O.

POST /replies, in this order (the first failure decides the status):

1. signature (Standard Webhooks, several secrets, timestamp tolerance) -> 401;
   the reply_id is the signed ``webhook-id``;
2. body size -> 413 (enforced by the shell while reading, before buffering);
3. Content-Type ``application/json`` (charset, if given, utf-8) -> 415;
4. strict JSON -> 400: UTF-8 only, no BOM, no NaN/Infinity, no duplicate keys,
   nesting at most ``MAX_DEPTH``, no lone surrogates and no NUL in strings or
   keys (``receiver.strict_json``). Any JSON value is accepted at the top
   level, because ``publish()`` may send any JSON value;
5. dedupe: 200 ``{"ack": "stored", "reply_id", "duplicate"}``, 409 on a
   collision, 503 when the store is unavailable (the relay retries).

Checks 1-4 (``check_message``) need no I/O; ``store_messages`` stores messages
that arrived together in one transaction, each with its own answer.

A signature is bound to its endpoint: POST /replies refuses a ``webhook-id``
starting with ``batch:``, POST /replies/batch requires one (400 otherwise), and
no reply_id may take that prefix, so a captured request replayed to the other
endpoint is refused.

POST /replies/batch takes the same checks 1-4 for the whole request, whose
JSON is ``{"replies": [{"reply_id": str, "body": str, "headers": {...},
"ordering_key": str}, ...]}`` (each body is the exact stored text of one
message, ``headers`` its optional headers as an object of strings,
``ordering_key`` its optional key, at most ``MAX_BATCH_ITEMS`` items), then
stores every valid item in ONE transaction with per-item dedupe, the items of
a key in request order, and answers 200 ``{"results": [{"reply_id", "status"}]}``
in request order, status one of ``stored``, ``duplicate``, ``conflict``,
``invalid`` (a bad reply_id or ordering key, a body that is not strict JSON, or
headers that are not an object of strings), ``retry`` (its effect raised:
nothing of it stored; with ``"error"``, the exception's class) or ``held`` (an
earlier item of its ordering key is ``retry``: not applied, so that the key's
order holds).

An effect that raises fails only its own message: in a group commit of single
messages the others are stored, and it answers 500.

GET /replies/{reply_id} is signed the same way with ``webhook-id`` equal to
the reply_id and an empty body; it answers the receipt (200) or 404.
Every answer carries ``RETENTION_HEADER``: how many seconds receipts are kept,
so a relay can refuse to resend past it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from json.encoder import encode_basestring
from typing import Any, Protocol

from outbox import tracing
from outbox.errors import SignatureError
from outbox.messages import BATCH_ID_PREFIX, ORDERING_KEY, are_reply_ids, is_reply_id
from outbox.signing import SigningKey, verify
from receiver.effects import Effect
from receiver.errors import StoreUnavailable
from receiver.spans import record_outcomes
from receiver.store import BatchItem, Receipt
from receiver.strict_json import MAX_DEPTH as MAX_DEPTH
from receiver.strict_json import InvalidJSON as InvalidJSON
from receiver.strict_json import check_strict_json
from receiver.strict_json import parse_strict_json as parse_strict_json

RETENTION_HEADER = "Outbox-Receipt-Retention"
RETRY_AFTER_SECONDS = 1
MAX_BATCH_ITEMS = 1000


class Store(Protocol):
    """What the receiver's rules need from a receipt store."""

    retention: float

    def accept_many(
        self, items: Sequence[BatchItem], effect: Effect | None = None, *, isolate: bool = False
    ) -> list[str]:
        """Store receipts in one transaction; see ReceiptStore.accept_many (the receiver
        passes isolate=True, and reads the reasons of `retry` from the result's `errors`)."""
        ...

    def lookup(self, reply_id: str) -> Receipt | None:
        """The stored receipt or None."""
        ...


@dataclass(frozen=True)
class Answer:
    """An HTTP answer: status, JSON document and extra headers."""

    status: int
    document: dict[str, Any] | bytes
    """The JSON document, or its compact UTF-8 text when the rules wrote it themselves."""
    headers: dict[str, str] = field(default_factory=dict)


def error(status: int, message: str, **headers: str) -> Answer:
    """An error answer with a short, non-secret reason."""
    return Answer(status, {"error": message}, dict(headers))


# The store is down or busy: nothing was stored, and Retry-After tells the relay when.
UNAVAILABLE = error(
    503, "receipt store unavailable, retry", **{"Retry-After": str(RETRY_AFTER_SECONDS)}
)


def is_json_content_type(value: str | None) -> bool:
    """Whether a Content-Type names JSON in UTF-8 (a missing charset means UTF-8)."""
    if not value:
        return False
    media, *params = (part.strip() for part in value.split(";"))
    if media.lower() != "application/json":
        return False
    for param in params:
        name, _, raw = param.partition("=")
        if name.strip().lower() == "charset" and raw.strip().strip('"').lower() not in (
            "utf-8",
            "utf8",
        ):
            return False
    return True


@dataclass(frozen=True)
class ReadBatch:
    """A batch request that passed its checks, its items read: what storing it needs."""

    items: list[Any]
    """The request's items as sent, in order."""
    ids: list[Any]
    """Each item's reply_id as sent (None when the item is not an object)."""
    valid: list[BatchItem]
    """The items to store."""
    positions: list[int]
    """Where each valid item stands among `items`."""

    def reply_ids(self) -> list[str]:
        """Every item's reply_id, or none when some item has none that can name it."""
        ids = self.ids
        return ids if all(isinstance(i, str) for i in ids) else []

    def contexts(self) -> list[Mapping[str, str]]:
        """The headers of each valid item, among which its creation context."""
        return [self.items[index].get("headers") or {} for index in self.positions]


@dataclass(frozen=True)
class ReceiverRules:
    """The receiver's decisions, given its store, secrets and limits."""

    store: Store
    keys: tuple[SigningKey, ...]
    tolerance: float
    max_body: int
    effect: Effect | None = None
    wall_clock: Callable[[], float] | None = None

    def retention_headers(self) -> dict[str, str]:
        """The header that publishes the receipt retention, on every answer."""
        return {RETENTION_HEADER: str(int(self.store.retention))}

    def _verify(self, headers: Mapping[str, str], body: bytes) -> str:
        now = None if self.wall_clock is None else self.wall_clock()
        return verify(self.keys, headers, body, tolerance=self.tolerance, now=now)

    def _checked(
        self,
        headers: Mapping[str, str],
        body: bytes,
        read: Callable[[bytes], Any] = parse_strict_json,
    ) -> tuple[str, Any] | Answer:
        """Checks 1-4, shared by both POSTs: (signed webhook-id, what `read` made of the
        JSON) or the refusal."""
        try:
            webhook_id = self._verify(headers, body)
        except SignatureError as exc:
            return error(401, str(exc))
        if len(body) > self.max_body:
            return error(413, f"body larger than {self.max_body} bytes")
        if not is_json_content_type(_header(headers, "content-type")):
            return error(415, "Content-Type must be application/json (UTF-8)")
        try:
            return webhook_id, read(body)
        except InvalidJSON as exc:
            return error(400, f"invalid JSON: {exc}")

    def check_message(self, headers: Mapping[str, str], body: bytes) -> tuple[str, bytes] | Answer:
        """The checks of POST /replies (no I/O): (reply_id, body) to store, or the refusal."""
        checked = self._checked(headers, body, check_strict_json)
        if isinstance(checked, Answer):
            return checked
        reply_id, _ = checked
        if not is_reply_id(reply_id):
            return error(
                400,
                f"webhook-id is not a valid reply_id (ids starting with {BATCH_ID_PREFIX!r} "
                "are for /replies/batch)",
            )
        return reply_id, body

    def store_messages(self, items: Sequence[tuple[str, bytes]]) -> list[Answer]:
        """Store checked single messages in ONE transaction; one answer each (blocking).

        Messages that arrive together share a commit (group commit); each keeps its
        own outcome, as if stored alone in arrival order.
        """
        try:
            statuses = self.store.accept_many(items, self.effect, isolate=True)
        except StoreUnavailable:
            return [UNAVAILABLE] * len(items)
        errors = _errors(statuses)
        return [
            error(409, f"reply_id {reply_id!r} was stored with a different body")
            if status == "conflict"
            else error(500, f"{errors.get(index, 'not stored')}; send it again")
            if status not in ("stored", "duplicate")
            else Answer(
                200, {"ack": "stored", "reply_id": reply_id, "duplicate": status == "duplicate"}
            )
            for index, ((reply_id, _), status) in enumerate(zip(items, statuses, strict=True))
        ]

    def post_batch(self, headers: Mapping[str, str], body: bytes) -> Answer:
        """Decide POST /replies/batch: one transaction, one status per item (blocking)."""
        read = self.read_batch(headers, body)
        return read if isinstance(read, Answer) else self.store_batch(read)

    def read_batch(self, headers: Mapping[str, str], body: bytes) -> ReadBatch | Answer:
        """The checks of POST /replies/batch and its items read (no I/O), or the refusal."""
        checked = self._checked(headers, body)
        if isinstance(checked, Answer):
            return checked
        batch_id, document = checked
        if not batch_id.startswith(BATCH_ID_PREFIX):
            # Signed for /replies: the same bytes must not be read as a batch.
            return error(400, f"webhook-id of a batch must start with {BATCH_ID_PREFIX!r}")
        items = document.get("replies") if isinstance(document, dict) else None
        if not isinstance(items, list) or not 1 <= len(items) <= MAX_BATCH_ITEMS:
            return error(400, f'expected {{"replies": [1..{MAX_BATCH_ITEMS} items]}}')
        valid: list[BatchItem] = []
        positions: list[int] = []
        ids: list[Any] = [
            item.get("reply_id") if isinstance(item, dict) else None for item in items
        ]
        # One pass for the usual batch, whose reply_ids are all good; else each is asked.
        good_ids = are_reply_ids(ids)
        for index, (item, reply_id) in enumerate(zip(items, ids, strict=True)):
            if not (good_ids or is_reply_id(reply_id)):
                continue
            text = item.get("body")
            key = item.get("ordering_key")
            if (
                not isinstance(text, str)
                or not _headers_or_none(item.get("headers"))
                or not (key is None or (isinstance(key, str) and ORDERING_KEY.fullmatch(key)))
            ):
                continue
            data = text.encode("utf-8")
            try:
                check_strict_json(data)
            except InvalidJSON:
                continue
            # An unkeyed item stays a pair: what a store of an application's own knew.
            valid.append((reply_id, data) if key is None else (reply_id, data, key))
            positions.append(index)
        return ReadBatch(items, ids, valid, positions)

    def store_batch(self, read: ReadBatch, span: tracing.Span = tracing.NOT_RECORDING) -> Answer:
        """Store a read batch's valid items in one transaction (blocking): one status per
        item, their outcomes on `span`, the request's process span."""
        statuses = ["invalid"] * len(read.items)
        errors: dict[int, str] = {}
        if read.valid:
            try:
                stored = self.store.accept_many(read.valid, self.effect, isolate=True)
            except StoreUnavailable:
                return UNAVAILABLE
            for index, status in zip(read.positions, stored, strict=True):
                statuses[index] = status
            errors = {read.positions[index]: reason for index, reason in _errors(stored).items()}
        record_outcomes(span, statuses)
        return Answer(
            200,
            _results_json(
                [reply_id if isinstance(reply_id, str) else "" for reply_id in read.ids],
                statuses,
                errors,
            ),
        )

    def get_reply(self, reply_id: str, headers: Mapping[str, str]) -> Answer:
        """Decide GET /replies/{reply_id}: signed with webhook-id = reply_id, empty body."""
        try:
            signed_id = self._verify(headers, b"")
        except SignatureError as exc:
            return error(401, str(exc))
        if signed_id != reply_id:
            return error(401, "webhook-id does not name the requested message")
        try:
            receipt = self.store.lookup(reply_id)
        except StoreUnavailable:
            return UNAVAILABLE
        if receipt is None:
            return error(404, f"no receipt for {reply_id!r} (never received, or purged)")
        return Answer(
            200,
            {
                "reply_id": receipt.reply_id,
                "content_hash": receipt.content_hash,
                "received_at": receipt.received_at,
            },
        )


def _results_json(
    reply_ids: Sequence[str], statuses: Sequence[str], errors: Mapping[int, str]
) -> bytes:
    """``{"results": [{"reply_id", "status"}, ...]}`` as json.dumps writes it compactly, with
    ``"error"`` on the items `errors` names by index.

    Written directly: a dict per item, then dumped, cost a batch of 1,000 about
    five times as much. Statuses are plain words; reply_ids and errors are escaped
    by the encoder json.dumps uses.
    """
    items = ",".join(
        [
            f'{{"reply_id":{encode_basestring(reply_id)},"status":"{status}"}}'
            for reply_id, status in zip(reply_ids, statuses, strict=True)
        ]
        if not errors
        else [
            f'{{"reply_id":{encode_basestring(reply_id)},"status":"{status}"'
            + (f',"error":{encode_basestring(errors[index])}}}' if index in errors else "}")
            for index, (reply_id, status) in enumerate(zip(reply_ids, statuses, strict=True))
        ]
    )
    return f'{{"results":[{items}]}}'.encode()


def _errors(statuses: Sequence[str]) -> Mapping[int, str]:
    """The reasons of the `retry` statuses, by index (a store of one's own may give none)."""
    errors: Mapping[int, str] = getattr(statuses, "errors", None) or {}
    return errors


def _headers_or_none(value: object) -> bool:
    """Whether a batch item's `headers` is absent or an object of strings."""
    return value is None or (
        isinstance(value, dict)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())
    )


def _header(headers: Mapping[str, str], name: str) -> str | None:
    for key, value in headers.items():
        if key.lower() == name:
            return value
    return None


def receiver_rules(
    store: Store,
    secrets: Iterable[SigningKey],
    *,
    tolerance: float,
    max_body: int,
    effect: Effect | None = None,
    wall_clock: Callable[[], float] | None = None,
) -> ReceiverRules:
    """A validated ReceiverRules: at least one secret, positive limits."""
    keys = tuple(secrets)
    if not keys:
        raise ValueError("the receiver needs at least one webhook secret")
    if isinstance(tolerance, bool) or not tolerance > 0:
        raise ValueError(f"tolerance must be a positive number of seconds, got {tolerance!r}")
    if isinstance(max_body, bool) or not isinstance(max_body, int) or max_body < 1:
        raise ValueError(f"max_body must be a positive int, got {max_body!r}")
    return ReceiverRules(store, keys, float(tolerance), max_body, effect, wall_clock)
