"""JetStream setup: the stream a NATS destination publishes into (relay.broker_setup).

A missing stream is created; an existing one gains the destination's subject and a
duplicate window as long as the relay's retry window, and keeps everything else.
"""

from __future__ import annotations

import contextlib
import json
import math
from typing import TYPE_CHECKING, Any

from outbox.clients import optional_client
from outbox.redaction import redact_urls
from relay.broker_setup import Change, covers, describe, stream_subject
from relay.destination import Destination
from relay.errors import SetupRefused, TransportError
from relay.policy import retains
from relay.transports.nats import NatsOptions

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.js.api import StreamConfig

_SUBJECTS_OVERLAP = 10065
"""JetStream's error code for subjects that another stream already captures."""


def stream_changes(
    config: StreamConfig, wanted: str, window: float, allow_short: bool
) -> tuple[dict[str, Any], list[str]]:
    """What an existing stream needs (fields to update) and why, in words.

    SetupRefused when it conflicts in a way only a destructive change would fix.
    """
    name = config.name
    if config.no_ack:
        raise SetupRefused(
            f"NATS stream {name!r} has no_ack set: it sends no PubAck, and a PubAck is what "
            "marks a message sent; this command does not change it: unset no_ack yourself "
            "or give the destination a stream of its own"
        )
    changes: dict[str, Any] = {}
    said: list[str] = []
    subjects = list(config.subjects or ())
    if not any(covers(subject, wanted) for subject in subjects):
        # JetStream refuses overlapping filters in one stream: those the new one captures
        # go, and the stream captures every subject it did and more.
        replaced = [subject for subject in subjects if covers(wanted, subject)]
        changes["subjects"] = [s for s in subjects if s not in replaced] + [wanted]
        instead = f" in place of {', '.join(replaced)}" if replaced else ""
        said.append(f"subject {wanted} added{instead}")
    current = float(config.duplicate_window or 0)
    max_age = float(config.max_age or 0)
    if not retains(current, window):
        if max_age and not retains(max_age, window):
            # JetStream refuses a duplicate window longer than max_age, and keeping
            # messages longer is the stream owner's decision, not this command's.
            why = (
                f"NATS stream {name!r} keeps messages for {max_age:g}s (max_age), and its "
                f"duplicate window ({current:g}s) cannot be raised past that to the relay's "
                f"retry window ({window:g}s)"
            )
            if not allow_short:
                raise SetupRefused(
                    f"{why}: raise its max_age, or set allow_short_retention on the destination"
                )
            said.append(f"duplicate window {current:g}s kept: allow_short_retention is set")
        else:
            changes["duplicate_window"] = whole_seconds(window)
            said.append(f"duplicate window {current:g}s -> {whole_seconds(window)}s")
    return changes, said


def whole_seconds(window: float) -> int:
    """The duplicate window to set for a retry window: whole seconds, rounded up, as the
    relay's hint says; a fractional one would come back from NATS a nanosecond short."""
    return math.ceil(window)


async def set_up_stream(destination: Destination, window: float, dry_run: bool) -> Change:
    """Create or update the JetStream stream of a NATS destination (see the module doc)."""
    nats: Any = optional_client("nats", "a destination of kind nats", "nats", "nats.js")
    options = destination.options
    assert isinstance(options, NatsOptions), "set up for NATS destinations only"
    name = options.stream
    wanted = stream_subject(options.subject)
    thing = f"NATS stream {name}"
    client = await _connect_nats(nats, destination)
    try:
        js = client.jetstream(timeout=destination.timeout)
        try:
            info = await js.stream_info(name)
        except nats.js.errors.NotFoundError:
            if not dry_run:
                await js.add_stream(
                    name=name,
                    subjects=[wanted],
                    duplicate_window=whole_seconds(window),
                    storage=nats.js.api.StorageType.FILE,
                )
            shown = f"subjects {wanted}, duplicate window {whole_seconds(window)}s"
            return Change(thing, "created", shown)
        config = info.config
        changes, said = stream_changes(config, wanted, window, destination.allow_short_retention)
        if not changes:
            shown = ", ".join(config.subjects or ())
            kept = f"subjects {shown}, duplicate window {float(config.duplicate_window or 0):g}s"
            return Change(thing, "unchanged", "; ".join([kept, *said]))
        if not dry_run:
            await update_stream_as_served(client, name, changes, destination.timeout)
        return Change(thing, "updated", "; ".join(said))
    except nats.js.errors.APIError as exc:
        refusal = f"NATS refused to set up stream {name!r}: {exc.description}"
        if exc.err_code == _SUBJECTS_OVERLAP:
            refusal += await _owner_of(js, wanted, name)
        raise SetupRefused(refusal) from None
    except (OSError, TimeoutError, nats.errors.Error) as exc:
        raise TransportError(f"{thing} not set up: {describe(exc)}") from None
    finally:
        with contextlib.suppress(Exception):  # closing what failed: its error is the one to say
            await client.close()


async def update_stream_as_served(
    client: Any, name: str, changes: dict[str, Any], timeout: float
) -> None:
    """Update a stream's `changes` (subjects, duplicate_window in seconds) and nothing else.

    A JetStream update replaces the whole configuration, and nats-py's model of it holds
    only the fields that nats-py knows: sent back through it, a field of a newer server
    would be reset to its default. So the configuration goes back as the server served
    it, as JSON, with only the changed fields set. APIError when JetStream refuses.
    """
    served = await _jetstream_request(client, f"$JS.API.STREAM.INFO.{name}", b"", timeout)
    config = dict(served["config"])
    if "subjects" in changes:
        config["subjects"] = list(changes["subjects"])
    if "duplicate_window" in changes:
        config["duplicate_window"] = int(changes["duplicate_window"] * 1_000_000_000)  # ns
    update = json.dumps(config).encode()
    await _jetstream_request(client, f"$JS.API.STREAM.UPDATE.{name}", update, timeout)


async def _jetstream_request(client: Any, subject: str, data: bytes, timeout: float) -> Any:
    """One JetStream API request's JSON answer; nats-py's APIError when it holds an error."""
    nats: Any = optional_client("nats", "a destination of kind nats", "nats", "nats.js")
    answer = json.loads((await client.request(subject, data, timeout=timeout)).data)
    error = answer.get("error")
    if error:
        raise nats.js.errors.APIError(
            code=error.get("code"),
            description=error.get("description"),
            err_code=error.get("err_code"),
        )
    return answer


async def _owner_of(js: Any, subject: str, name: str) -> str:
    """`; stream X captures ...` naming another stream that holds the subject, or ""."""
    try:
        other = await js.find_stream_name_by_subject(subject)
    except Exception:  # noqa: BLE001 - only a hint: the refusal is said without it
        return ""
    if other == name:
        return ""
    return (
        f"; stream {other!r} captures subjects of {subject}: give the destination that "
        "stream, or a subject no other stream captures"
    )


async def _connect_nats(nats: Any, destination: Destination) -> Client:
    """A connection of its own that never reconnects: one failure is the answer."""

    async def quiet(exc: Exception) -> None:
        """The failure is reported once, by the exception connect raises."""

    try:
        client: Client = await nats.connect(
            destination.url,
            allow_reconnect=False,
            max_reconnect_attempts=1,
            reconnect_time_wait=0,
            connect_timeout=destination.timeout,
            error_cb=quiet,
            name="outbox-broker-setup",
        )
    except (OSError, TimeoutError, nats.errors.Error) as exc:
        raise TransportError(
            f"cannot connect to NATS at {redact_urls(destination.url)}: {describe(exc)}"
        ) from None
    return client
