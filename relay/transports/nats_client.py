"""The relay's fast NATS client: parcels queued at once, header blocks sent as they are,
PubAcks read straight from the protocol parser.

A destination uses it unless it sets `fast_client = false`. The client sends a
HeaderBlock's bytes (relay.transports.nats_wire) without nats-py's per-publish
encoding, queues a parcel's publishes as a few commands (`publish_many`), and hands
each answer to the relay's inbox to a plain function (`subscribe_answers`) rather
than through a message object, a subscription queue and a callback task.

The client overrides two internal methods of nats-py's Client (`_send_publish`,
`_process_msg`) and calls others. At first use they are checked against nats-py's
own: same parameters, the same bytes for sample headers that exercise each encoding rule,
and sample answers fed through nats-py's parser arriving as they were sent. When
any differs (another nats-py release), the relay uses nats-py's own client, with
a warning: slower, not different.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from relay.transports.nats_wire import AnswerHandler, HeaderBlock, Publish, hpub_command

log = logging.getLogger("outbox.relay")

_SIGNATURES = (
    ("_send_publish", ["self", "subject", "reply", "payload", "payload_size", "headers"]),
    ("_process_msg", ["self", "sid", "subject", "reply", "data", "headers"]),
    ("_send_command", ["self", "cmd", "priority"]),
    ("_flush_pending", ["self", "force_flush"]),
)
"""The parameters of the internal methods this module overrides or calls (nats-py 2.16)."""

CHUNK_BYTES = 256 * 1024
"""The relay's client queues a parcel's publishes in commands of about this size: one per
message costs more, one per parcel of large bodies would copy them all at once."""

_SAMPLE_HEADERS = {
    "Nats-Msg-Id": "r-1",
    " padded ": "  both ends ",
    "crlf": "one\r\ntwo",
    "": "an empty name is left out",
    "unicode": "caf\u00e9",
}
"""Headers the start check sends through both encodings: each rule nats-py applies."""


def _overridable(base: type) -> bool:
    """Whether nats-py's Client still has the internals relay_client relies on."""
    for name, parameters in _SIGNATURES:
        method = getattr(base, name, None)
        if method is None or list(inspect.signature(method).parameters) != parameters:
            return False
    needed = ["_flush_queue", "_process_headers", "_ps", "stats"]
    needed += ["is_closed", "is_connected", "is_draining_pubs", "max_payload"]
    return all(hasattr(base(), name) for name in needed)


def queued_command(client: Any, subject: str, headers: Mapping[str, str]) -> bytes | None:
    """What `client` (never connected) queues for the socket to publish `headers` on
    `subject`; None when it did not finish without waiting."""
    queued: list[bytes] = []

    async def capture(cmd: bytes, priority: bool = False) -> None:
        queued.append(cmd)

    client._send_command = capture
    payload = b'{"sample":1}'
    # Not connected, nats-py's method queues and returns without ever waiting: one step of
    # the coroutine runs it to its end, on any thread, with or without a running loop.
    step = client._send_publish(subject, "_INBOX.sample.1", payload, len(payload), headers)
    try:
        step.send(None)
    except StopIteration:
        return queued[0] if len(queued) == 1 else None
    step.close()
    return None


_SAMPLE_ANSWERS = (
    b'MSG _INBOX.sample.7 1 14\r\n{"stream":"S"}\r\nMSG _INBOX.other.1 2 2\r\n{}\r\n'
    b"HMSG _INBOX.sample.8 1 16 16\r\nNATS/1.0 503\r\n\r\n\r\n"
)
"""Two answers to the inbox `_INBOX.sample` (a PubAck, a no-responders status) and a
message to another inbox, as nats-server sends them."""


def _answers_directly(ours: type) -> bool:
    """Whether `ours` hands the sample answers to the handler as they were sent, and
    leaves the other message to nats-py."""
    taken: list[tuple[str, bytes, Mapping[str, str] | None]] = []
    left: list[bytes] = []
    try:
        client = ours()
        client.take_answers("_INBOX.sample", lambda *answer: taken.append(answer))

        async def other(sid: int, subject: bytes, *rest: Any) -> None:
            left.append(subject)

        client._process_msg_of_nats = other
        step = client._ps.parse(_SAMPLE_ANSWERS)
        try:
            step.send(None)
        except StopIteration:
            pass
        else:
            step.close()
            return False
    except Exception:  # noqa: BLE001 - any surprise means: not the shape this module knows
        return False
    expected = [("7", b'{"stream":"S"}', None), ("8", b"", {"Status": "503"})]
    return taken == expected and left == [b"_INBOX.other.1"]


def _same_bytes(base: type, ours: type) -> bool:
    """Whether `ours` sends what `base` (nats-py's own encoding) sends, for the sample."""
    try:
        theirs = queued_command(base(), "sample.subject", dict(_SAMPLE_HEADERS))
        mine = queued_command(ours(), "sample.subject", HeaderBlock(_SAMPLE_HEADERS))
    except Exception:  # noqa: BLE001 - any surprise means: not the shape this module knows
        return False
    return theirs is not None and theirs == mine


@functools.cache
def relay_client(nats: Any) -> type:
    """nats-py's Client, sending a HeaderBlock's bytes as they are (see the module)."""
    base: type = nats.aio.client.Client
    errors = nats.errors

    class RelayClient(base):  # type: ignore[misc]
        async def _send_publish(
            self,
            subject: str,
            reply: str,
            payload: bytes,
            payload_size: int,
            headers: Mapping[str, str] | None,
        ) -> None:
            if not isinstance(headers, HeaderBlock):
                await super()._send_publish(subject, reply, payload, payload_size, headers)
                return
            if not subject:
                # As nats-py's own method: "HPUB  <reply> ..." would publish to the reply.
                raise errors.BadSubjectError
            await self._queue([hpub_command(subject, reply, headers.block, payload)], payload_size)

        async def publish_many(self, publishes: Sequence[Publish]) -> None:
            """Publish each as publish() would, the commands queued a chunk at a time;
            subjects are not validated (the relay builds them), and a connection that is not
            up refuses rather than buffers (the relay's do not reconnect)."""
            if self.is_closed or not self.is_connected:
                # The relay's connections do not reconnect: nothing to buffer for.
                raise errors.ConnectionClosedError
            if self.is_draining_pubs:
                raise errors.ConnectionDrainingError
            commands: list[bytes] = []
            queued = payloads = 0
            for subject, reply, payload, headers, _ in publishes:
                if not subject:
                    raise errors.BadSubjectError
                if len(payload) > self.max_payload:
                    raise errors.MaxPayloadError
                command = hpub_command(subject, reply, headers.block, payload)
                commands.append(command)
                queued += len(command)
                payloads += len(payload)
                if queued >= CHUNK_BYTES:
                    await self._queue(commands, payloads)
                    commands, queued, payloads = [], 0, 0
            if commands:
                await self._queue(commands, payloads)

        async def _queue(self, commands: list[bytes], payloads: int) -> None:
            # As nats-py's own publish does after encoding: count, queue, and wake its
            # flusher once per burst.
            self.stats["out_msgs"] += len(commands)
            self.stats["out_bytes"] += payloads
            await self._send_command(b"".join(commands))
            if self._flush_queue is not None and self._flush_queue.empty():
                await self._flush_pending()

        _answers: tuple[bytes, AnswerHandler] | None = None
        """The relay's inbox (as a subject prefix) and the handler of its answers."""

        def take_answers(self, inbox: str, handler: AnswerHandler) -> None:
            """Hand answers to `inbox` straight to `handler` (subscribe_answers)."""
            self._answers = (f"{inbox}.".encode(), handler)

        async def _process_msg(
            self, sid: int, subject: bytes, reply: bytes, data: bytes, headers: bytes | None
        ) -> None:
            answers = self._answers
            if answers is None or not subject.startswith(answers[0]):
                await self._process_msg_of_nats(sid, subject, reply, data, headers)
                return
            # A message object, the subscription's queue and task, and a callback coroutine
            # per answer cost more than reading the answer does.
            self.stats["in_msgs"] += 1
            self.stats["in_bytes"] += len(data)
            status = await self._process_headers(headers) if headers else None
            try:
                answers[1](subject[len(answers[0]) :].decode(errors="replace"), data, status)
            except Exception as exc:  # noqa: BLE001 - raised on, it would stop the reading
                # As a subscription's callback error: reported, and the next answer read.
                await self._error_cb(exc)

        async def _process_msg_of_nats(
            self, sid: int, subject: bytes, reply: bytes, data: bytes, headers: bytes | None
        ) -> None:
            await super()._process_msg(sid, subject, reply, data, headers)

    if _overridable(base) and _same_bytes(base, RelayClient) and _answers_directly(RelayClient):
        return RelayClient
    log.warning(
        "nats-py %s: its internals are not the ones the relay checked; publishing and "
        "reading PubAcks through nats-py's own client (slower, the same bytes)",
        getattr(nats.aio.client, "__version__", "?"),
    )
    return base
