"""The lane: one held connection for the first caller at a time, a pooled one otherwise."""

from __future__ import annotations

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


def test_a_lanes_setup_stays_on_its_own_connection(engine: sa.Engine) -> None:
    cache_size = sa.text("PRAGMA cache_size")
    with engine.connect() as conn:
        default = conn.execute(cache_size).scalar()
    lane = Lane(engine, setup="PRAGMA cache_size = 1234")
    with lane.connection() as conn:
        assert conn.execute(cache_size).scalar() == 1234
        held = raw(conn)
    with lane.connection() as conn:  # kept, with its setting
        assert raw(conn) is held
        with lane.connection() as busy:  # a pooled one, without it
            assert busy.execute(cache_size).scalar() == default
    with pytest.raises(sa.exc.OperationalError), lane.connection() as conn:
        conn.execute(sa.text("SELECT * FROM no_such_table"))
    # Dropped after the error: closed, not given back to the pool with the setting.
    with engine.connect() as conn:
        assert raw(conn) is not held
        assert conn.execute(cache_size).scalar() == default
    with lane.connection() as conn:  # a new held connection gets the setting again
        assert raw(conn) is not held
        assert conn.execute(cache_size).scalar() == 1234
    lane.close()
    with engine.connect() as conn:
        assert conn.execute(cache_size).scalar() == default
