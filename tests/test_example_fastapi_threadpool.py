"""ReceiptStore from async endpoints: the thread pool path of examples/fastapi_receiver.py.

The store is synchronous. The example calls it through `run_in_threadpool`, as
docs/reference/receiver-contract.md (*ReceiptStore from async endpoints*) tells integrators to.
These tests hold an accept inside its effect, with its transaction open, and show that
the event loop keeps answering meanwhile, and that the same delivery arriving many times
at once through the async endpoint applies the effect once.
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session
from support.receiver_helpers import SECRET, signed, stored_receipts

import outbox
from examples import fastapi_receiver
from receiver import Receipt, ReceiptStore
from receiver.effects import REPLY_ID_KEY, Effect

# The longest any one wait may take before the test fails: nothing here waits for time
# to pass, only for events another thread sets.
DEADLINE = 10.0
BODY = b'{"order":7}'


@pytest.fixture
def store(db_url: str) -> Iterator[ReceiptStore]:
    """The example's store (with its own effect table) on the test database."""
    opened = fastapi_receiver.open_store(db_url)
    try:
        yield opened
    finally:
        fastapi_receiver.metadata.drop_all(opened.engine)
        opened.close()


def applied(store: ReceiptStore) -> Counter[str]:
    """How many times the example's effect ran, per reply_id."""
    table = fastapi_receiver.applied
    with store.engine.connect() as conn:
        return Counter(conn.execute(sa.select(table.c.reply_id)).scalars())


def client(store: ReceiptStore) -> httpx.AsyncClient:
    """A client calling the example app in this event loop: a blocked loop stops both."""
    app = fastapi_receiver.create_app(store, [SECRET])
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://example")


def hold_effect(
    monkeypatch: pytest.MonkeyPatch, until: threading.Event, reached: threading.Event
) -> None:
    """Make the example's effect set `reached`, then wait for `until` before it writes."""
    real: Effect = fastapi_receiver.apply

    def held(session: Session, body: bytes) -> None:
        reached.set()
        if not until.wait(DEADLINE):
            until.set()  # fail once: a later effect must not wait out the deadline again
            raise AssertionError(f"{session.info[REPLY_ID_KEY]}: the effect was never released")
        real(session, body)

    # The endpoint reads the module's `apply` at each request.
    monkeypatch.setattr(fastapi_receiver, "apply", held)


def test_an_accept_held_in_its_effect_leaves_the_event_loop_answering(
    store: ReceiptStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    release, holding = threading.Event(), threading.Event()
    hold_effect(monkeypatch, release, holding)

    async def scenario() -> None:
        async with client(store) as http:
            held = asyncio.ensure_future(
                http.post("/replies", content=BODY, headers=signed("held", BODY))
            )
            try:
                assert await asyncio.to_thread(holding.wait, DEADLINE), "the effect never ran"
                # The accept sits in its effect with its transaction open. Had it run on the
                # event loop, nothing below would be answered until it gave up.
                health = await asyncio.wait_for(http.get("/healthz"), DEADLINE)
                lookup = http.get("/replies/held", headers=signed("held", b""))
                looked_up = await asyncio.wait_for(lookup, DEADLINE)
                assert not held.done(), "the event loop answered nothing while the accept ran"
                assert health.status_code == 200
                # Another store call ran in the thread pool meanwhile; the receipt is not
                # there yet, since its transaction has not committed.
                assert looked_up.status_code == 404
                release.set()
                answer = await asyncio.wait_for(held, DEADLINE)
            finally:
                release.set()  # never leave the held thread waiting out its deadline
            assert (answer.status_code, answer.json()["duplicate"]) == (200, False)
            found = await http.get("/replies/held", headers=signed("held", b""))
            assert found.status_code == 200

    asyncio.run(scenario())
    assert applied(store) == Counter(["held"])


def test_the_same_delivery_many_times_at_once_applies_the_effect_once(
    store: ReceiptStore, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    copies = 12
    all_in, effect_ran = threading.Event(), threading.Event()
    # The first receipt's effect waits until every copy has reached the store: all of
    # them then run at once, in the thread pool, against its open transaction.
    hold_effect(monkeypatch, all_in, effect_ran)
    lock = threading.Lock()
    entered = 0
    accept = store.accept

    def counting_accept(reply_id: str, body: bytes, effect: Effect | None = None) -> Receipt:
        nonlocal entered
        with lock:
            entered += 1
            if entered == copies:
                all_in.set()
        return accept(reply_id, body, effect)

    monkeypatch.setattr(store, "accept", counting_accept)

    async def scenario() -> list[httpx.Response]:
        async with client(store) as http:
            posts = [
                http.post("/replies", content=BODY, headers=signed("dup", BODY))
                for _ in range(copies)
            ]
            return await asyncio.wait_for(asyncio.gather(*posts), DEADLINE * 2)

    answers = asyncio.run(scenario())
    assert effect_ran.is_set()
    assert [answer.status_code for answer in answers] == [200] * copies
    assert Counter(answer.json()["duplicate"] for answer in answers) == {
        False: 1,
        True: copies - 1,
    }
    assert applied(store) == Counter({"dup": 1})
    assert stored_receipts(db_url) == {"dup": BODY}


def test_a_store_call_that_finds_no_free_connection_answers_503(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One connection, and a short wait for it: the held accept keeps it, so the next
    # delivery runs out of connections, not of threads.
    engine = outbox.create_engine(db_url, pool_size=1, max_overflow=0, pool_timeout=0.2)
    fastapi_receiver.metadata.create_all(engine)
    store = ReceiptStore(engine)
    release, holding = threading.Event(), threading.Event()
    hold_effect(monkeypatch, release, holding)

    async def scenario() -> None:
        async with client(store) as http:
            held = asyncio.ensure_future(
                http.post("/replies", content=BODY, headers=signed("held", BODY))
            )
            try:
                assert await asyncio.to_thread(holding.wait, DEADLINE), "the effect never ran"
                other = await asyncio.wait_for(
                    http.post("/replies", content=BODY, headers=signed("other", BODY)), DEADLINE
                )
                # Temporary: the relay sends it again later, so nothing is lost.
                assert (other.status_code, other.headers["retry-after"]) == (503, "1")
                release.set()
                assert (await asyncio.wait_for(held, DEADLINE)).status_code == 200
            finally:
                release.set()
            again = await http.post("/replies", content=BODY, headers=signed("other", BODY))
            assert again.status_code == 200

    try:
        asyncio.run(scenario())
        assert applied(store) == Counter(["held", "other"])
    finally:
        fastapi_receiver.metadata.drop_all(engine)
        engine.dispose()
