"""The lane: one held connection for the first caller at a time, a pooled one otherwise."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from outbox.db import lane as lane_module
from outbox.db.lane import IDLE_SECONDS, Lane


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[sa.Engine]:
    """A pooled SQLite engine: the lane's behaviour does not depend on the backend."""
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'lane.db'}", pool_size=4)
    yield engine
    engine.dispose()


def raw(conn: sa.Connection) -> object:
    """The DBAPI connection under a SQLAlchemy one: the same object when it is reused."""
    return conn.connection.dbapi_connection


def test_the_held_connection_is_reused_and_a_busy_lane_lends_a_pooled_one(
    engine: sa.Engine,
) -> None:
    lane = Lane(engine)
    with lane.connection() as first:
        held = raw(first)
        with lane.connection() as second:  # the lane is busy: no waiting, another one
            assert raw(second) is not held
    with lane.connection() as again:
        assert raw(again) is held
    lane.close()


def test_another_thread_never_waits_for_the_lane(engine: sa.Engine) -> None:
    lane = Lane(engine)
    inside, done = threading.Event(), threading.Event()

    def other() -> None:
        with lane.connection() as conn:
            conn.execute(sa.text("SELECT 1"))
        done.set()

    with lane.connection():
        inside.set()
        thread = threading.Thread(target=other)
        thread.start()
        assert done.wait(10)  # finished while this caller still holds the lane
    thread.join()
    lane.close()


def test_an_error_drops_the_held_connection(engine: sa.Engine) -> None:
    lane = Lane(engine)
    with pytest.raises(sa.exc.OperationalError), lane.connection() as failed:
        failed.execute(sa.text("SELECT * FROM no_such_table"))
    assert lane._held is None
    assert failed.closed
    with lane.connection() as conn:
        assert conn is not failed  # a new one, taken after the error
        assert lane._held is conn
    lane.close()


def test_an_idle_connection_is_given_back_before_the_next_statement(
    engine: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    now = [1000.0]
    monkeypatch.setattr(lane_module.time, "monotonic", lambda: now[0])
    lane = Lane(engine)
    with lane.connection() as conn:
        first = conn
    with lane.connection() as conn:
        assert conn is first  # within IDLE_SECONDS: the same one
    now[0] += IDLE_SECONDS + 1
    with lane.connection() as conn:
        assert conn is not first
        assert first.closed
    lane.close()


def test_a_closed_lane_holds_nothing(engine: sa.Engine) -> None:
    lane = Lane(engine)
    with lane.connection():
        pass
    lane.close()
    assert lane._held is None
    with lane.connection() as conn:
        conn.execute(sa.text("SELECT 1"))
    assert lane._held is None  # a pooled connection, given back


CACHE_SIZE = sa.text("PRAGMA cache_size")
SETUP = "PRAGMA cache_size = 1234"
DEFAULT_CACHE_SIZE = -2000


def cache_size(conn: sa.Connection) -> int:
    """The connection's page cache setting: SQLite's stand-in for a session setting."""
    return int(conn.execute(CACHE_SIZE).scalar_one())


def test_a_lanes_setup_stays_on_its_own_connection(engine: sa.Engine) -> None:
    lane = Lane(engine, SETUP)
    with lane.connection() as conn:
        assert cache_size(conn) == 1234
        held = raw(conn)
    with lane.connection() as conn:  # kept, with its setting
        assert raw(conn) is held
        assert cache_size(conn) == 1234
        with lane.connection() as busy:  # a pooled one, with it too
            assert cache_size(busy) == 1234
    with pytest.raises(sa.exc.OperationalError), lane.connection() as conn:
        conn.execute(sa.text("SELECT * FROM no_such_table"))
    # Dropped after the error: closed, never lent by the pool with the setting.
    with engine.connect() as first, engine.connect() as second:
        assert held not in (raw(first), raw(second))
        assert cache_size(first) == cache_size(second) == DEFAULT_CACHE_SIZE
    with lane.connection() as conn:  # the next held connection gets the setting
        assert cache_size(conn) == 1234
    lane.close()
    with engine.connect() as conn:
        assert cache_size(conn) == DEFAULT_CACHE_SIZE


def test_a_connection_still_set_is_never_lent_by_the_pool(engine: sa.Engine) -> None:
    lane = Lane(engine, SETUP)
    with lane.connection() as conn:
        held = raw(conn)
        conn.close()  # a caller handing the lane's connection back itself
    with engine.connect() as conn:
        assert raw(conn) is not held
        assert cache_size(conn) == DEFAULT_CACHE_SIZE
    with lane.connection() as conn:  # the lane finds it closed and takes another
        assert raw(conn) is not held
        assert cache_size(conn) == 1234
    del lane  # never closed: its connection goes back to the pool as collected
    gc.collect()
    with engine.connect() as conn:
        assert cache_size(conn) == DEFAULT_CACHE_SIZE


def test_a_setup_that_fails_leaves_no_connection_behind(engine: sa.Engine) -> None:
    lane = Lane(engine, "PRAGMA no_such_pragma = (")
    with pytest.raises(sa.exc.OperationalError), lane.connection():
        pass
    assert lane._held is None
    lane._setup = SETUP  # the setup works again: the next connection gets it
    with lane.connection() as conn:
        assert cache_size(conn) == 1234
    lane.close()


def test_a_stand_in_for_a_busy_or_closed_lane_has_the_setup_and_is_discarded(
    engine: sa.Engine,
) -> None:
    lane = Lane(engine, SETUP)
    with lane.connection() as conn:
        held = raw(conn)
        with lane.connection() as busy:
            stand_in = raw(busy)
            assert stand_in is not held
            assert cache_size(busy) == 1234
    with engine.connect() as first, engine.connect() as second:
        assert stand_in not in (raw(first), raw(second))
        assert cache_size(first) == cache_size(second) == DEFAULT_CACHE_SIZE
    lane.close()
    with lane.connection() as closed:
        stand_in = raw(closed)
        assert cache_size(closed) == 1234
    with engine.connect() as first, engine.connect() as second:
        assert stand_in not in (raw(first), raw(second))
        assert cache_size(first) == cache_size(second) == DEFAULT_CACHE_SIZE
