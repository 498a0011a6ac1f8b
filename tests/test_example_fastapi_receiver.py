"""The integrator's example (examples/fastapi_receiver.py) against the real relay.

docs/reference/receiver-contract.md tells someone writing their own receiver what to answer;
the example follows it with receiver.verify and ReceiptStore. Here the relay
delivers to the example served by uvicorn, and every promise of the document that
the example keeps is checked where it shows: in the relay's rows, in the receipts
and in the example's own effect table.
"""

from __future__ import annotations

import base64
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
import sqlalchemy as sa
from support.receiver_helpers import AppClient, stored_receipts, wait_until
from support.relay_helpers import SECRET, publish_many, rows
from support.served import Served

import outbox
from examples import fastapi_receiver
from outbox.canonical import sha256_hex
from outbox.errors import ConfigError
from outbox.signing import sign
from outbox.testing import Crash, ManualClock, arm
from receiver import ReceiptStore
from relay import Destination, Relay, make_destination

OTHER_SECRET = "whsec_" + base64.b64encode(b"a-secret-the-example-never-saw").decode()


@dataclass
class Example:
    """The example app being served, and the receipt store behind it."""

    base: str
    store: ReceiptStore

    @property
    def url(self) -> str:
        """The destination url the relay posts single messages to."""
        return self.base + "/replies"


@pytest.fixture
def example(db_url: str) -> Iterator[Example]:
    """The example app on the test database, served on loopback."""
    store = fastapi_receiver.open_store(db_url)
    try:
        with Served(fastapi_receiver.create_app(store, [SECRET])) as served:
            yield Example(served.base, store)
    finally:
        # Not one of the tables the fixtures empty between tests: the example's own.
        fastapi_receiver.metadata.drop_all(store.engine)
        store.close()


@pytest.fixture
def engine(db_url: str) -> Iterator[sa.Engine]:
    """An engine on the test database (the outbox side)."""
    created = outbox.create_engine(db_url)
    yield created
    created.dispose()


TIMEOUT = 8
"""Seconds a request to the example may take: its first answer comes from a cold app, on
a machine that may be busy; under the 10 s lease one relay here runs with, as the relay requires."""
LEASE = TIMEOUT + 4
"""The relays' lease, longer than a request as the relay requires; only the manual clock
runs it out."""


def destination(example: Example, secret: str = SECRET) -> Destination:
    """The example as a relay destination, as its docstring says to configure it."""
    return make_destination(
        example.url, secret=secret, timeout=TIMEOUT, receipt_lookup=True, require_retention=True
    )


def applied(example: Example) -> Counter[str]:
    """How many times the example's effect ran, per reply_id."""
    table = fastapi_receiver.applied
    with example.store.engine.connect() as conn:
        return Counter(row.reply_id for row in conn.execute(sa.select(table.c.reply_id)))


def bodies(engine: sa.Engine, ids: list[str]) -> dict[str, bytes]:
    """The exact stored body of each message."""
    stored = rows(engine)
    return {reply_id: bytes(stored[reply_id]["body"]) for reply_id in ids}


class RelayThread:
    """Relay.run() on a thread, keeping whatever ended it so the test can see it."""

    def __init__(self, relay: Relay) -> None:
        self.relay = relay
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        try:
            self.relay.run(install_signal_handlers=False)
        except BaseException as exc:
            self.error = exc

    def running(self) -> bool:
        """Whether it still runs; raises what stopped it if it failed."""
        if self.error is not None:
            raise AssertionError(f"the relay stopped: {self.error!r}") from self.error
        return self.thread.is_alive()

    def __enter__(self) -> RelayThread:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        # stop() is a no-op until run() has begun: ask until the thread has ended.
        deadline = time.monotonic() + 30
        while self.thread.is_alive() and time.monotonic() < deadline:
            self.relay.stop()
            self.thread.join(timeout=0.05)
        assert not self.thread.is_alive(), "the relay did not stop"


def test_the_running_relay_delivers_every_message_once(
    db_url: str, engine: sa.Engine, example: Example
) -> None:
    ids = [f"m-{n:02d}" for n in range(20)]
    publish_many(engine, ids)
    publish_many(engine, ids[:3])  # the same reply_id and body again: a no-op
    assert len(rows(engine)) == len(ids)

    # require_retention: run() refuses to start unless the example publishes its retention.
    relay = Relay(db_url, {"default": destination(example)}, lease=10, poll_interval=0.05)
    with relay, RelayThread(relay) as running:

        def delivered() -> bool:
            assert running.running()
            return all(row["state"] == "sent" for row in rows(engine).values())

        wait_until(delivered, 30, "every message to be sent")

    stored = rows(engine)
    assert {i: (stored[i]["attempts"], stored[i]["last_status"]) for i in ids} == dict.fromkeys(
        ids, (1, 200)
    )
    assert stored_receipts(db_url) == bodies(engine, ids)
    assert applied(example) == Counter(ids)


def test_a_resend_after_a_lost_answer_is_a_duplicate_applied_once(
    db_url: str, engine: sa.Engine, example: Example, clock: ManualClock
) -> None:
    ids = ["r-1", "r-2"]
    publish_many(engine, ids, clock=clock)
    target = {"default": destination(example)}
    with (
        Relay(db_url, target, clock=clock, owner="relay-a", lease=LEASE) as crashed,
        Relay(db_url, target, clock=clock, owner="relay-b", lease=LEASE) as survivor,
    ):
        # The example committed both; the relay died before recording the answers.
        with arm("relay.after_remote_commit"), pytest.raises(Crash):
            crashed.dispatch_once()
        assert applied(example) == Counter(ids)
        clock.advance(LEASE + 1)  # relay-a's lease runs out: relay-b sends the same bytes again
        assert sorted(survivor.dispatch_once()) == [("r-1", "sent"), ("r-2", "sent")]
    assert [row["attempts"] for row in rows(engine).values()] == [2, 2]
    assert stored_receipts(db_url) == bodies(engine, ids)
    assert applied(example) == Counter(ids)


def test_the_receipt_lookup_settles_a_send_whose_outcome_was_lost(
    db_url: str, engine: sa.Engine, example: Example, clock: ManualClock
) -> None:
    held, never_sent = "k/1?x#y%2F", "k-2"  # percent-encoded in the lookup's path
    publish_many(engine, [held], clock=clock)
    target = {"default": destination(example)}
    with (
        Relay(db_url, target, clock=clock, owner="relay-a", lease=LEASE, max_attempts=1) as crashed,
        Relay(
            db_url, target, clock=clock, owner="relay-b", lease=LEASE, max_attempts=1
        ) as survivor,
    ):
        with arm("relay.after_remote_commit"), pytest.raises(Crash):
            crashed.dispatch_once()  # posted and stored, then the relay died
        publish_many(engine, [never_sent], clock=clock)
        assert len(crashed.leases.claim()[0]) == 1  # claimed, then died before posting
        clock.advance(LEASE + 1)
        # No attempts left for either: the lookup decides, and only the example's 200
        # with the matching content_hash makes a message sent.
        assert sorted(survivor.dispatch_once()) == [(never_sent, "dead"), (held, "sent")]
    stored = rows(engine)
    assert stored[held]["attempts"] == 1
    assert stored[never_sent]["last_error"].startswith(
        "outcome unknown: lease expired while sending"
    )
    assert stored_receipts(db_url) == bodies(engine, [held])
    assert applied(example) == Counter([held])


def test_same_reply_id_other_body_is_a_conflict_and_dead(
    db_url: str, engine: sa.Engine, example: Example, clock: ManualClock
) -> None:
    example.store.accept("c-1", b'{"someone":"else"}', fastapi_receiver.apply)
    publish_many(engine, ["c-1", "c-2"], clock=clock)
    with Relay(db_url, {"default": destination(example)}, clock=clock) as relay:
        assert sorted(relay.dispatch_once()) == [("c-1", "dead"), ("c-2", "sent")]
    row = rows(engine)["c-1"]
    assert (row["state"], row["last_status"], row["attempts"]) == ("dead", 409, 1)
    assert stored_receipts(db_url) == {"c-1": b'{"someone":"else"}', **bodies(engine, ["c-2"])}
    assert applied(example) == Counter(["c-1", "c-2"])


def test_a_delivery_signed_with_another_secret_is_refused_and_dead(
    db_url: str, engine: sa.Engine, example: Example, clock: ManualClock
) -> None:
    publish_many(engine, ["s-1"], clock=clock)
    target = {"default": destination(example, secret=OTHER_SECRET)}
    with Relay(db_url, target, clock=clock) as relay:
        assert relay.dispatch_once() == [("s-1", "dead")]
    row = rows(engine)["s-1"]
    assert (row["last_status"], row["attempts"]) == (401, 1)
    assert "no signature matches a current secret" in row["last_error"]
    assert stored_receipts(db_url) == {}
    assert applied(example) == Counter()


def test_a_relay_refuses_to_start_when_receipts_are_kept_too_briefly(db_url: str) -> None:
    # 60 s of receipts, far less than the relay's longest retry window (705 s here).
    store = ReceiptStore(db_url, retention=60)
    try:
        with Served(fastapi_receiver.create_app(store, [SECRET])) as served:
            relay = Relay(db_url, {"default": destination(Example(served.base, store))})
            with relay, RelayThread(relay) as running:
                wait_until(lambda: not running.thread.is_alive(), 30, "the relay to refuse")
    finally:
        store.close()
    assert isinstance(running.error, ConfigError)
    assert "keeps receipts for 1m" in str(running.error)


def signed(reply_id: str, body: bytes, secret: str = SECRET, **changes: str) -> dict[str, str]:
    """The headers the relay would send for `body` as `reply_id`, with `changes` applied."""
    headers = {"content-type": "application/json", **sign(secret, reply_id, None, body)}
    return {**headers, **changes}


def test_the_answers_the_document_promises(example: Example, db_url: str) -> None:
    body = b'{"id":"h-1"}'
    with httpx.Client(base_url=example.base, timeout=10) as http:
        tampered = http.post("/replies", content=b'{"id":"h-2"}', headers=signed("h-1", body))
        assert tampered.status_code == 401
        forged = signed("h-1", body, **{"webhook-signature": "v1," + "A" * 44})
        assert http.post("/replies", content=body, headers=forged).status_code == 401
        stale = signed("h-1", body, **{"webhook-timestamp": str(int(time.time()) - 3600)})
        assert http.post("/replies", content=body, headers=stale).status_code == 401
        not_json = http.post("/replies", content=b"{", headers=signed("h-1", b"{"))
        assert not_json.status_code == 400
        batch = b'{"replies":[{"reply_id":"h-3","body":"{}"}]}'
        replayed = http.post("/replies", content=batch, headers=signed("batch:1-1-1", batch))
        assert replayed.status_code == 400  # a batch's signature does not fit this endpoint
        assert stored_receipts(db_url) == {}
        assert applied(example) == Counter()

        first = http.post("/replies", content=body, headers=signed("h-1", body))
        again = http.post("/replies", content=body, headers=signed("h-1", body))
        other = http.post("/replies", content=b'{"id":2}', headers=signed("h-1", b'{"id":2}'))
        assert (first.status_code, first.json()["duplicate"]) == (200, False)
        assert (again.status_code, again.json()["duplicate"]) == (200, True)
        assert other.status_code == 409
        assert stored_receipts(db_url) == {"h-1": body}
        assert applied(example) == Counter(["h-1"])

        found = http.get("/replies/h-1", headers=signed("h-1", b""))
        assert found.status_code == 200
        assert found.json()["content_hash"] == sha256_hex(body)
        assert http.get("/replies/h-9", headers=signed("h-9", b"")).status_code == 404
        assert http.get("/replies/h-1").status_code == 401  # unsigned
        assert http.get("/replies/h-1", headers=signed("h-9", b"")).status_code == 401

        health = http.get("/healthz")
        assert health.status_code == 200
        assert health.headers["outbox-receipt-retention"] == str(int(example.store.retention))


def test_a_body_over_the_limit_is_refused_before_it_is_stored(
    example: Example, db_url: str
) -> None:
    # In-process: over a socket the refusal may reach the client as a reset mid-upload.
    huge = b'"' + b"x" * fastapi_receiver.MAX_BODY + b'"'
    app = fastapi_receiver.create_app(example.store, [SECRET])
    with AppClient(app) as client:
        assert client.post("/replies", content=huge, headers=signed("h-1", huge)).status_code == 413
    assert stored_receipts(db_url) == {}
