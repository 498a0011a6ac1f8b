"""32 concurrent identical deliveries give exactly one effect and no errors, on both backends."""

from __future__ import annotations

import multiprocessing
import queue
import threading
from collections import Counter

import pytest
import sqlalchemy as sa
from support.receiver_helpers import accept_in_child, count_effects, stored_receipts

import outbox
from receiver import ReceiptStore
from receiver.effects import record_effect

N = 32
BODY = b'{"kind":"result","task_id":"t-1","status":"done","result":{"n":1}}'


def test_threads_sharing_one_store(db_url: str) -> None:
    engine = outbox.create_engine(db_url, pool_size=N + 8)
    store = ReceiptStore(engine)
    barrier = threading.Barrier(N)
    outcomes: list[str] = []
    lock = threading.Lock()

    def deliver() -> None:
        try:
            barrier.wait(timeout=30)
            receipt = store.accept("reply:t-1", BODY, record_effect)
            outcome = "duplicate" if receipt.duplicate else "stored"
        except Exception as exc:
            outcome = f"error: {exc!r}"
        with lock:
            outcomes.append(outcome)

    threads = [threading.Thread(target=deliver) for _ in range(N)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert not any(thread.is_alive() for thread in threads)
    finally:
        engine.dispose()
    assert Counter(outcomes) == {"stored": 1, "duplicate": N - 1}
    assert count_effects(db_url) == 1
    assert stored_receipts(db_url) == {"reply:t-1": BODY}


def test_separate_processes(db_url: str) -> None:
    # Children fork from a clean server process that imported the store once, so 32 real
    # processes start in a fraction of the time 32 spawned interpreters take.
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["receiver_helpers", "receiver.store"])
    barrier = ctx.Barrier(N)
    results = ctx.Queue()
    procs = [
        ctx.Process(target=accept_in_child, args=(db_url, "reply:t-1", BODY, barrier, results))
        for _ in range(N)
    ]
    for proc in procs:
        proc.start()
    outcomes = []
    try:
        for _ in range(N):
            outcomes.append(results.get(timeout=120))
    except queue.Empty:
        pytest.fail(f"only {len(outcomes)} of {N} processes answered: {Counter(outcomes)}")
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
                proc.join()
        results.close()
        results.join_thread()
    assert Counter(outcomes) == {"stored": 1, "duplicate": N - 1}
    assert all(proc.exitcode == 0 for proc in procs)
    assert count_effects(db_url) == 1
    assert stored_receipts(db_url) == {"reply:t-1": BODY}


def test_the_effect_row_is_counted_not_hidden(db_url: str) -> None:
    # The concurrency tests count rows; this shows a second effect would be counted.
    engine = outbox.create_engine(db_url)
    try:
        with engine.begin() as conn:
            for _ in range(2):
                conn.execute(
                    sa.text(
                        "INSERT INTO receiver_effects (reply_id, body, created_at) "
                        "VALUES ('x', :b, 0)"
                    ),
                    {"b": b"{}"},
                )
    finally:
        engine.dispose()
    assert count_effects(db_url, "x") == 2


@pytest.mark.parametrize("backend", ["postgresql"])
def test_serialization_failures_are_retried_not_reported(db_url: str) -> None:
    # Under REPEATABLE READ, ON CONFLICT against a row committed after our snapshot raises
    # SerializationFailure; the store retries by error class and still answers "duplicate".
    engine = outbox.create_engine(db_url, pool_size=N + 8, isolation_level="REPEATABLE READ")
    store = ReceiptStore(engine)
    barrier = threading.Barrier(N)
    outcomes: list[str] = []
    lock = threading.Lock()

    def deliver() -> None:
        try:
            barrier.wait(timeout=30)
            outcome = (
                "duplicate" if store.accept("r-rr", BODY, record_effect).duplicate else "stored"
            )
        except Exception as exc:
            outcome = f"error: {exc!r}"
        with lock:
            outcomes.append(outcome)

    threads = [threading.Thread(target=deliver) for _ in range(N)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
    finally:
        engine.dispose()
    assert Counter(outcomes) == {"stored": 1, "duplicate": N - 1}
    assert count_effects(db_url) == 1
