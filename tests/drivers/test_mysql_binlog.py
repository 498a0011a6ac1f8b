"""A MySQL server whose binary log records statements cannot take SKIP LOCKED claims, nor
an engine of the application's at REPEATABLE READ: the worker's queue and the relay
refuse either at start, naming the setting."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from outbox import TaskQueue, Worker
from outbox.drivers import Driver
from outbox.drivers.mysql.engine import MySQLEngines, binlog_refusal
from outbox.errors import ConfigError
from relay import Relay, make_destination


@pytest.mark.parametrize(
    ("log_bin", "binlog_format", "refused"),
    [
        (True, "STATEMENT", True),
        (True, "statement", True),
        (True, "ROW", False),
        (True, "MIXED", False),
        (False, "STATEMENT", False),  # no binary log, nothing replayed
    ],
)
def test_only_a_statement_binary_log_is_refused(
    log_bin: bool, binlog_format: str, refused: bool
) -> None:
    refusal = binlog_refusal(log_bin, binlog_format)
    assert (refusal is not None) is refused
    if refused:
        assert refusal is not None
        assert "binlog_format" in refusal
        assert "ROW or MIXED" in refusal


@pytest.mark.parametrize("backend", ["mysql"], indirect=True)
def test_the_server_is_read_on_its_connection(driver: Driver, engine: sa.Engine) -> None:
    with engine.connect() as conn:
        log_bin = bool(conn.execute(sa.text("SELECT @@log_bin")).scalar_one())
        conn.execute(sa.text("SET SESSION binlog_format = 'STATEMENT'"))
        refusal = driver.server_refusal(conn)
    assert (refusal is not None) is log_bin


@pytest.mark.parametrize("backend", ["mysql"], indirect=True)
def test_the_queue_and_the_relay_refuse_such_a_server_at_start(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    statements = binlog_refusal(log_bin=True, binlog_format="STATEMENT")
    monkeypatch.setattr(MySQLEngines, "server_refusal", lambda self, conn: statements)
    with TaskQueue(db_url) as queue:  # receiving tasks claims nothing: not refused
        with pytest.raises(ConfigError, match=r"binlog_format=STATEMENT"):
            queue.claim_many("w", 1)
        with pytest.raises(ConfigError, match=r"binlog_format=STATEMENT"):
            Worker(queue, lambda task: None)
        with pytest.raises(ConfigError, match=r"binlog_format=STATEMENT"):
            queue.reconcile()
    with pytest.raises(ConfigError, match=r"binlog_format=STATEMENT"):
        Relay(db_url, {"orders": make_destination("http://127.0.0.1:9/", secret="s" * 32)})


@pytest.mark.parametrize("backend", ["mysql"], indirect=True)
def test_an_engine_of_the_applications_at_repeatable_read_is_refused_until_read_committed(
    db_url: str,
) -> None:
    own = sa.create_engine(db_url, isolation_level="REPEATABLE READ")
    try:
        refused = pytest.raises(ConfigError, match=r"REPEATABLE READ.*READ COMMITTED")
        with TaskQueue(own) as queue, refused:
            Worker(queue, lambda task: None)
        with pytest.raises(ConfigError, match=r"REPEATABLE READ.*READ COMMITTED"):
            Relay(own, {"orders": make_destination("http://127.0.0.1:9/", secret="s" * 32)})
        with TaskQueue(own.execution_options(isolation_level="READ COMMITTED")) as queue:
            assert queue.claim_many("w", 1) == []
    finally:
        own.dispose()


@pytest.mark.parametrize("backend", ["mysql"], indirect=True)
def test_an_engine_in_autocommit_is_refused(db_url: str) -> None:
    own = sa.create_engine(db_url, isolation_level="AUTOCOMMIT")
    try:
        with pytest.raises(ConfigError, match=r"autocommit"):
            Relay(own, {"orders": make_destination("http://127.0.0.1:9/", secret="s" * 32)})
        with TaskQueue(own) as queue, pytest.raises(ConfigError, match=r"autocommit"):
            queue.claim_many("w", 1)
    finally:
        own.dispose()
