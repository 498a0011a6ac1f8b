"""MySQL and MariaDB: what InnoDB's locking asks of the driver, each with a test.

Claims run at READ COMMITTED (REPEATABLE READ's gap locks would hold publishers' inserts
behind a claim), concurrent claims skip each other's rows, deadlocks and lock waits
that ran out are retried by the one retry policy, and identifiers and bodies are stored
byte for byte.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from support.driver_helpers import START, message_row, published
from support.task_rows import task_values

from outbox.db.dialect import create_engine
from outbox.db.retry import is_transient, waited_for_lock
from outbox.drivers import Driver
from outbox.drivers.mysql import tenant_lock

pytestmark = pytest.mark.parametrize("backend", ["mysql"], indirect=True)
LEASE = 30.0


def claim(driver: Driver, conn: sa.Connection, owner: str, limit: int = 10) -> list[str]:
    """The reply_ids one claim of `orders` at START leases to `owner`."""
    rows = driver.claim_messages(
        conn, owner=owner, now=START, lease=LEASE, limit=limit, budget=3, destinations=["orders"]
    )
    return sorted(row.reply_id for row in rows)


@pytest.fixture
def impatient(engine: sa.Engine) -> Iterator[sa.Connection]:
    """A second connection of the toolkit's engine that waits one second for a row lock."""
    with engine.connect() as conn:
        conn.execute(sa.text("SET SESSION innodb_lock_wait_timeout = 1"))
        conn.commit()
        yield conn


def test_the_toolkits_engines_run_at_read_committed(engine: sa.Engine) -> None:
    with engine.connect() as conn:
        assert conn.get_isolation_level() == "READ COMMITTED"


@pytest.mark.parametrize("isolation", ["READ COMMITTED", "REPEATABLE READ"])
def test_a_claim_under_way_holds_no_publisher_behind_it(
    driver: Driver, db_url: str, isolation: str
) -> None:
    # The claim walks the pending range (state, available_at, id) and locks what it read.
    # At REPEATABLE READ that walk also locks the gaps between the rows, so a publisher's
    # message due between two claimed ones waits for the claim's COMMIT.
    engine = create_engine(db_url, isolation_level=isolation)
    try:
        with engine.begin() as conn:
            published(driver, conn, "first", START - 30)
            published(driver, conn, "third", START - 10)
        with engine.begin() as claiming:
            assert claim(driver, claiming, "relay-1") == ["first", "third"]
            with engine.connect() as publisher:
                publisher.execute(sa.text("SET SESSION innodb_lock_wait_timeout = 1"))
                publisher.commit()
                with publisher.begin():
                    insert = lambda: driver.insert_message(  # noqa: E731
                        publisher, message_row("second"), START - 20
                    )
                    if isolation == "READ COMMITTED":
                        assert insert() is not None
                    else:
                        with pytest.raises(sa.exc.OperationalError) as waited:
                            insert()
                        assert waited_for_lock(waited.value)
    finally:
        engine.dispose()


def test_concurrent_claims_skip_each_others_rows(
    driver: Driver, engine: sa.Engine, impatient: sa.Connection
) -> None:
    with engine.begin() as conn:
        for n in range(4):
            published(driver, conn, f"m{n}", START - 40 + n)
    with engine.begin() as first:
        assert claim(driver, first, "relay-1", limit=2) == ["m0", "m1"]
        # SKIP LOCKED: the second claim neither waits for the first nor takes its rows.
        with impatient.begin():
            assert claim(driver, impatient, "relay-2", limit=10) == ["m2", "m3"]


def test_a_reconcile_under_way_leaves_the_due_tasks_to_a_claim(
    driver: Driver, engine: sa.Engine, impatient: sa.Connection
) -> None:
    # A locking walk of (state, deadline) for past deadlines would lock the record that
    # ends it, the pending task due next, and a concurrent claim would skip that task.
    with engine.begin() as conn:
        driver.insert_task(conn, task_values("due"))
    with engine.begin() as reconciling:
        assert driver.expire_past_deadline(reconciling, START + 10, 10) == []
        assert driver.reap_expired_task_leases(reconciling, START + 10, 10) == []
        with impatient.begin():
            rows = driver.claim_tasks(impatient, owner="w", now=START + 10, lease=30.0, limit=1)
            assert [row["task_id"] for row in rows] == ["due"]


def test_capped_claims_wait_for_each_others_commit(
    driver: Driver, engine: sa.Engine, impatient: sa.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two pending tasks of one tenant, a cap of one: the second claimer must count the
    # first one's running task, so it cannot claim while that claim's transaction is open.
    monkeypatch.setattr(tenant_lock, "TAKE", sa.text(f"SELECT GET_LOCK({tenant_lock.NAME}, 0)"))
    with engine.begin() as conn:
        driver.insert_task(conn, task_values("one", created_at=START))
        driver.insert_task(conn, task_values("two", created_at=START + 1))

    def capped_claim(conn: sa.Connection, owner: str) -> list[str]:
        rows = driver.claim_tasks(
            conn, owner=owner, now=START + 10, lease=30.0, limit=1, tenant_cap=1
        )
        return [row["task_id"] for row in rows]

    with engine.begin() as first:
        assert capped_claim(first, "w1") == ["one"]
        # Row locks alone would let it take "two", counting no running task of the tenant.
        with impatient.begin(), pytest.raises(tenant_lock.TenantCapsBusy):
            capped_claim(impatient, "w2")
    with engine.begin() as second:
        assert capped_claim(second, "w2") == []


def test_a_capped_claim_that_waited_out_the_lock_is_tried_again_not_fatal(driver: Driver) -> None:
    # A worker's producer retries what its driver names a database error; anything else
    # ends the worker, and one stalled claimer would stop every other capped worker.
    assert issubclass(tenant_lock.TenantCapsBusy, driver.database_errors)


def test_the_caps_lock_is_this_databases_own(engine: sa.Engine, impatient: sa.Connection) -> None:
    other = f"outbox_other_{uuid.uuid4().hex[:12]}"
    with engine.connect() as conn:
        conn.execute(sa.text(f"CREATE DATABASE `{other}`"))
    try:
        with engine.connect() as conn, conn.begin():
            tenant_lock.lock_tenant_caps(conn)
            with impatient.begin():
                # Held here: not in this database on another session, free in another one.
                assert (
                    impatient.execute(sa.text(f"SELECT IS_FREE_LOCK({tenant_lock.NAME})")).scalar()
                    == 0
                )
                own = impatient.execute(sa.text("SELECT DATABASE()")).scalar_one()
                impatient.execute(sa.text(f"USE `{other}`"))
                assert (
                    impatient.execute(sa.text(f"SELECT IS_FREE_LOCK({tenant_lock.NAME})")).scalar()
                    == 1
                )
                impatient.execute(sa.text(f"USE `{own}`"))
    finally:
        with engine.connect() as conn:
            conn.execute(sa.text(f"DROP DATABASE IF EXISTS `{other}`"))


def test_a_deadlock_is_transient_for_the_one_retry_policy(
    driver: Driver, engine: sa.Engine, impatient: sa.Connection
) -> None:
    with engine.begin() as conn:
        published(driver, conn, "a", START)
        published(driver, conn, "b", START)
    lock = sa.text("SELECT id FROM outbox_messages WHERE reply_id = :r FOR UPDATE")
    errors: list[BaseException] = []
    b_held = threading.Event()

    def other_order() -> None:
        with engine.connect() as other, other.begin():
            other.execute(lock, {"r": "b"})
            b_held.set()
            try:
                other.execute(lock, {"r": "a"})
            except sa.exc.DBAPIError as exc:
                errors.append(exc)

    impatient.execute(sa.text("SET SESSION innodb_lock_wait_timeout = 5"))
    impatient.commit()
    with impatient.begin():
        impatient.execute(lock, {"r": "a"})
        worker = threading.Thread(target=other_order)
        worker.start()
        assert b_held.wait(5)
        try:
            # Each now waits for the other, in whichever order the two requests arrive:
            # InnoDB ends one of them with error 1213 and the other gets its row.
            impatient.execute(lock, {"r": "b"})
        except sa.exc.DBAPIError as exc:
            errors.append(exc)
    worker.join(10)
    deadlocks = [e for e in errors if getattr(e, "orig", None) and e.orig.args[0] == 1213]
    assert len(deadlocks) == 1, errors
    assert is_transient(deadlocks[0])
    assert driver.transient(deadlocks[0].orig) is True
    assert not waited_for_lock(deadlocks[0])


def test_a_lock_wait_that_ran_out_is_retried_by_the_one_policy_after_its_wait(
    driver: Driver, engine: sa.Engine, impatient: sa.Connection
) -> None:
    # Error 1205 has SQLSTATE HY000, which PostgreSQL's reading would call permanent: the
    # policy must hear MySQL's driver on it.
    with engine.begin() as conn:
        published(driver, conn, "held", START)
    lock = sa.text("SELECT id FROM outbox_messages WHERE reply_id = 'held' FOR UPDATE")
    with engine.begin() as holder:
        holder.execute(lock)
        with impatient.begin(), pytest.raises(sa.exc.OperationalError) as waited:
            impatient.execute(lock)
    assert waited.value.orig.args[0] == 1205
    assert is_transient(waited.value)
    assert waited_for_lock(waited.value)


def test_identifiers_compare_and_bodies_come_back_byte_for_byte(
    driver: Driver, conn: sa.Connection
) -> None:
    # A binary NO PAD collation: "A" and "a", "é" and "e", "a" and "a " are different
    # reply_ids, as on PostgreSQL.
    body = bytes(range(256)) * 300  # past BLOB's 64 KiB
    for reply_id in ("Order-1", "order-1", "ordér-1", "order-1 "):
        assert driver.insert_message(conn, message_row(reply_id, body=body), START) is not None
    stored = driver.message(conn, "ordér-1")
    assert stored is not None
    assert bytes(stored["body"]) == body
    assert driver.insert_message(conn, message_row("Order-1"), START) is None


def test_a_chain_neither_waits_on_rows_others_hold_nor_skips_one_of_its_key(
    driver: Driver, engine: sa.Engine, impatient: sa.Connection
) -> None:
    # Keys interleaved in id order; another transaction holds one row of another key (a
    # relay settling it) and the key's third message (another claim's, say).
    with engine.begin() as conn:
        for n in range(4):
            published(driver, conn, f"k-{n}", START - 10 + n, ordering_key="k")
            published(driver, conn, f"y-{n}", START - 10 + n, ordering_key="y")
    hold = sa.text("SELECT id FROM outbox_messages WHERE reply_id IN ('y-1', 'k-2') FOR UPDATE")
    with engine.connect() as other, other.begin():
        other.execute(hold)
        with impatient.begin():
            # No lock wait (it would raise 1205 after one second here); k's chain ends
            # before k-2, whose lock is held, and k-3 waits for it; y's first is claimed
            # and its chain stops at y-1.
            taken = claim(driver, impatient, "relay-b")
    assert taken == ["k-0", "k-1", "y-0"]
