"""Broker setup: the JetStream stream, or the RabbitMQ exchange and queue, a destination needs.

The relay refuses to start when a NATS destination's stream is missing, does not
capture its subject, or keeps a duplicate window shorter than the relay's retry
window, and when a RabbitMQ destination's exchange is missing. Setting up creates
what is missing and raises what is too small; it never shrinks or deletes
anything. What could only be fixed by destroying something is refused, with the
reason. Run twice, the second run changes nothing and says so.

This module holds what both brokers' setups share: the report of each change, and the
subject filters and binding keys a destination's template needs. The setups themselves
are relay.nats_setup (JetStream) and relay.rabbitmq_setup (RabbitMQ).
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from typing import Literal

from outbox.errors import ConfigError
from outbox.redaction import redact
from relay.transports.nats_wire import render_subject, subject_matches

Action = Literal["created", "updated", "unchanged", "ensured", "nothing to set up"]
_FIELD = "\x00"
"""Stands for a template field while its tokens are found: no template holds a NUL."""


@dataclass(frozen=True)
class Change:
    """One thing on a broker, and what setup did to it (or, in a dry run, would do)."""

    thing: str
    action: Action
    detail: str = ""

    def line(self, dry_run: bool = False) -> str:
        """`thing: action (detail)`; in a dry run, `would be created` and the like."""
        done = (
            f"would be {self.action}"
            if dry_run and self.action in ("created", "updated", "ensured")
            else self.action
        )
        return f"{self.thing}: {done}" + (f" ({self.detail})" if self.detail else "")


def with_wildcards(template: str, wildcard: str) -> str:
    """The template with each dot-separated token that holds a field replaced by `wildcard`."""
    text = "".join(
        literal + ("" if field is None else _FIELD)
        for literal, field, _, _ in string.Formatter().parse(template)
    )
    return ".".join(wildcard if _FIELD in token else token for token in text.split("."))


def stream_subject(template: str) -> str:
    """The subject filter that captures every subject a NATS subject template publishes on.

    An ordering key fills exactly one token (relay.transports.nats_wire.subject_token
    percent-encodes its dots), so each token holding {ordering_key} becomes `*`.
    """
    wanted = with_wildcards(template, "*")
    sample = render_subject(template, None)
    if not subject_matches(wanted, sample):
        raise ConfigError(f"subject {template!r}: no stream subject captures it as {sample!r}")
    return wanted


def binding_key(template: str) -> str:
    """The topic binding key that matches every routing key a template produces.

    An ordering key goes into the routing key as it is, dots included, so it may
    fill several words: each word holding {ordering_key} becomes `#`.
    """
    return with_wildcards(template, "#")


def covers(subject_filter: str, wanted: str) -> bool:
    """Whether a stream's subject filter captures every subject that `wanted` matches."""
    have, need = subject_filter.split("."), wanted.split(".")
    for index, part in enumerate(have):
        if part == ">":
            return len(need) > index
        if index >= len(need) or need[index] == ">":
            return False
        if part != "*" and part != need[index]:
            return False
    return len(need) == len(have)


def describe(exc: BaseException) -> str:
    """An error's class and text, with URL credentials and secrets hidden."""
    text = str(exc).strip()
    return redact(f"{type(exc).__name__}: {text}" if text else type(exc).__name__)
