"""Intake: validate an envelope, derive its identity, and describe what to store.

No I/O here: TaskQueue.receive runs the transaction. The rules are in
docs/explanation/contract.md#intake-limits; every violation raises InvalidEnvelope before
anything is written.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

from outbox.canonical import MAX_DEPTH, MAX_NODES, NotCanonical, canonical_bytes, sha256_hex
from outbox.errors import InvalidEnvelope, Unauthorized

MAX_MESSAGE_ID_BYTES = 128
MAX_NAME_CHARS = 200  # principals, tenants and owners share the column size
MAX_HOPS_VALUE = 2**31 - 1
PRIORITY_RANGE = (-(2**31), 2**31 - 1)
MAX_ATTEMPTS_RANGE = (1, 10)


@dataclass(frozen=True)
class AuthContext:
    """Who is calling, as established by a trusted adapter after real authentication."""

    principal: str
    tenant_id: str | None = None


@dataclass(frozen=True)
class Envelope:
    """An incoming task as a source submits it."""

    message_id: str
    sender: str
    payload: dict[str, Any]
    deadline: float | datetime
    max_attempts: int = 3
    hops: int = 0
    kind: str = "task"
    priority: int = 0


@dataclass(frozen=True)
class Ack:
    """Receipt: the envelope is durably stored (never a claim that the work is done)."""

    task_id: str
    duplicate: bool
    ack: Literal["stored"] = field(default="stored")


@dataclass(frozen=True)
class Accepted:
    """A validated envelope with its identity and canonical content, ready to store."""

    principal: str
    tenant_id: str
    message_id: str
    task_id: str
    content: str
    content_hash: str
    payload: str
    deadline: float
    max_attempts: int
    hops: int
    priority: int


def task_id_for(principal: str, message_id: str) -> str:
    """The task identity: sha256 of canonical JSON [principal, message_id]."""
    return sha256_hex(canonical_bytes([principal, message_id]))


def authorize(auth: object, envelope: object, allowed_sources: frozenset[str]) -> AuthContext:
    """Return the context when it may submit this envelope; raise Unauthorized otherwise."""
    if not isinstance(auth, AuthContext) or not isinstance(auth.principal, str):
        raise Unauthorized("an AuthContext from a trusted authentication adapter is required")
    if auth.principal not in allowed_sources:
        raise Unauthorized(f"source {auth.principal!r} is not allowed")
    if getattr(envelope, "sender", None) != auth.principal:
        raise Unauthorized("envelope sender does not match the authenticated principal")
    return auth


def accept(auth: AuthContext, envelope: Envelope) -> Accepted:
    """Validate an authorized envelope and compute its identity and canonical form."""
    if not isinstance(envelope, Envelope):
        raise InvalidEnvelope(f"expected an Envelope, got {type(envelope).__name__}")
    message_id = _message_id(envelope.message_id)
    if envelope.kind != "task":
        raise InvalidEnvelope(f"kind must be 'task', got {envelope.kind!r}")
    deadline = _deadline(envelope.deadline)
    max_attempts = _bounded_int("max_attempts", envelope.max_attempts, *MAX_ATTEMPTS_RANGE)
    hops = _bounded_int("hops", envelope.hops, 0, MAX_HOPS_VALUE)
    priority = _bounded_int("priority", envelope.priority, *PRIORITY_RANGE)
    if not isinstance(envelope.payload, dict):
        raise InvalidEnvelope(f"payload must be a dict, got {type(envelope.payload).__name__}")
    try:
        payload = canonical_bytes(envelope.payload).decode("utf-8")
        content = {
            "kind": "task",
            "message_id": message_id,
            "sender": envelope.sender,
            "payload": envelope.payload,
            "deadline": deadline,
            "max_attempts": max_attempts,
            "hops": hops,
            "priority": priority,
        }
        # The payload passed its limits above; the wrapper adds one level and its own fields.
        content_bytes = canonical_bytes(
            content,
            max_bytes=None,
            max_depth=MAX_DEPTH + 1,
            max_nodes=MAX_NODES + len(content),
        )
    except NotCanonical as exc:
        raise InvalidEnvelope(f"payload: {exc}") from exc
    return Accepted(
        principal=auth.principal,
        tenant_id=_tenant(auth),
        message_id=message_id,
        task_id=task_id_for(auth.principal, message_id),
        content=content_bytes.decode("utf-8"),
        content_hash=sha256_hex(content_bytes),
        payload=payload,
        deadline=deadline,
        max_attempts=max_attempts,
        hops=hops,
        priority=priority,
    )


def check_name(what: str, value: object) -> str:
    """A principal, tenant or owner name: 1..200 characters without NUL, else ValueError."""
    if not isinstance(value, str) or not 1 <= len(value) <= MAX_NAME_CHARS or "\x00" in value:
        raise ValueError(f"{what} must be a str of 1..{MAX_NAME_CHARS} characters without NUL")
    return value


def _tenant(auth: AuthContext) -> str:
    try:
        return check_name("tenant_id", auth.principal if auth.tenant_id is None else auth.tenant_id)
    except ValueError as exc:
        raise InvalidEnvelope(str(exc)) from exc


def _message_id(value: object) -> str:
    if not isinstance(value, str):
        raise InvalidEnvelope(f"message_id must be a str, got {type(value).__name__}")
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise InvalidEnvelope("message_id is not valid Unicode") from exc
    if not 1 <= size <= MAX_MESSAGE_ID_BYTES:
        raise InvalidEnvelope(
            f"message_id must be 1..{MAX_MESSAGE_ID_BYTES} UTF-8 bytes, got {size}"
        )
    if "\x00" in value:
        # PostgreSQL text cannot hold NUL: refuse it on every backend alike.
        raise InvalidEnvelope("message_id must not contain NUL characters")
    return value


def _deadline(value: object) -> float:
    if isinstance(value, datetime):
        if value.tzinfo is None or value.utcoffset() is None:
            raise InvalidEnvelope("deadline datetime must be timezone-aware")
        return value.timestamp()
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidEnvelope(f"deadline must be epoch seconds or an aware datetime, got {value!r}")
    try:
        seconds = float(value)
    except OverflowError as exc:
        raise InvalidEnvelope("deadline is out of range") from exc
    if not math.isfinite(seconds):
        raise InvalidEnvelope(f"deadline must be finite, got {value!r}")
    return seconds


def _bounded_int(name: str, value: object, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidEnvelope(f"{name} must be an int, got {type(value).__name__}")
    if not low <= value <= high:
        raise InvalidEnvelope(f"{name} must be in {low}..{high}, got {value}")
    return value
