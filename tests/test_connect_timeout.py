"""PostgreSQL connections are opened within CONNECT_TIMEOUT unless the URL says otherwise."""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa
from psycopg.conninfo import conninfo_to_dict
from sqlalchemy import event

import outbox
from outbox.drivers.postgresql.conninfo import CONNECT_TIMEOUT, bounded_conninfo


def connect_parameters(url: str, **kwargs: Any) -> dict[str, Any]:
    """The keyword arguments the engine's first connection is opened with (not opened)."""
    engine = outbox.create_engine(url, **kwargs)
    seen: dict[str, Any] = {}

    def capture(_dialect: Any, _record: Any, _args: Any, params: dict[str, Any]) -> Any:
        seen.update(params)
        raise ConnectionAbortedError("captured")  # nothing needs to be reached

    event.listen(engine, "do_connect", capture)
    try:
        with pytest.raises(ConnectionAbortedError), engine.connect():
            pass
    finally:
        engine.dispose()
    return seen


def test_a_postgresql_engine_bounds_its_connects() -> None:
    params = connect_parameters("postgresql+psycopg://postgres@192.0.2.1/outbox")
    assert params["connect_timeout"] == CONNECT_TIMEOUT


def test_the_urls_own_connect_timeout_wins() -> None:
    params = connect_parameters("postgresql+psycopg://postgres@192.0.2.1/outbox?connect_timeout=17")
    assert str(params["connect_timeout"]) == "17"


def test_the_callers_connect_args_win_and_are_kept() -> None:
    params = connect_parameters(
        "postgresql+psycopg://postgres@192.0.2.1/outbox",
        connect_args={"connect_timeout": 2, "application_name": "orders"},
    )
    assert params["connect_timeout"] == 2
    assert params["application_name"] == "orders"


def test_sqlite_engines_get_no_connect_timeout(tmp_path: Any) -> None:
    engine = outbox.create_engine(f"sqlite:///{tmp_path / 'outbox.db'}")
    try:
        with engine.connect() as conn:
            assert conn.execute(sa.text("SELECT 1")).scalar_one() == 1
    finally:
        engine.dispose()


def test_a_listen_connection_keeps_the_urls_own_bound() -> None:
    assert conninfo_to_dict(bounded_conninfo("host=db dbname=outbox")) == {
        "host": "db",
        "dbname": "outbox",
        "connect_timeout": str(CONNECT_TIMEOUT),
    }
    for given in ("postgresql://db/outbox?connect_timeout=30", "host=db connect_timeout=30"):
        assert bounded_conninfo(given) == given


def test_pgconnect_timeout_in_the_environment_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PGCONNECT_TIMEOUT", "40")
    assert bounded_conninfo("host=db dbname=outbox") == "host=db dbname=outbox"
    assert "connect_timeout" not in connect_parameters("postgresql+psycopg://postgres@192.0.2.1/o")
