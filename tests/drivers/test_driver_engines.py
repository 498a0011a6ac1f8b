"""Engines: the URLs a driver runs on, its engine set-up, and its missing-table error."""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa
from psycopg.pq import Format
from support.driver_helpers import START, published

from outbox.drivers import DRIVERS, Driver, UnsupportedDatabase, driver_for_url
from outbox.drivers.execution import BINARY_ROWS

TEXT, BINARY = Format.TEXT, Format.BINARY


def test_each_driver_is_found_by_the_urls_of_its_backend(backend: str, db_url: str) -> None:
    driver = driver_for_url(db_url)
    assert driver is DRIVERS[backend]
    assert sa.make_url(db_url).get_backend_name() in driver.url_backends


def test_the_own_url_keeps_the_database_and_its_backend(driver: Driver, db_url: str) -> None:
    url = sa.make_url(db_url)
    own = driver.own_url(url)
    assert own.database == url.database
    assert own.get_backend_name() == driver.name


def test_prepare_engine_twice_installs_once(driver: Driver, db_url: str) -> None:
    engine = sa.create_engine(driver.own_url(sa.make_url(db_url)))
    try:
        driver.prepare_engine(engine)
        driver.prepare_engine(engine)
        # Installed twice, SQLite's discipline would BEGIN inside its own transaction.
        with engine.begin() as conn:
            assert conn.execute(sa.text("SELECT 1")).scalar_one() == 1
    finally:
        engine.dispose()


def test_a_url_of_no_drivers_backend_is_refused_naming_the_supported_ones() -> None:
    with pytest.raises(UnsupportedDatabase, match=r"^unsupported database 'mssql': use "):
        driver_for_url("mssql+pyodbc://db/app")


def test_the_test_server_lets_the_claims_run(driver: Driver, engine: sa.Engine) -> None:
    with engine.connect() as conn:
        assert driver.server_refusal(conn) is None


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_binary_rows_load_as_text_rows_do_and_the_relays_claim_asks_for_them(
    driver: Driver, engine: sa.Engine
) -> None:
    formats: list[int] = []

    @sa.event.listens_for(engine, "after_cursor_execute")
    def result_format(*args: Any) -> None:
        cursor = args[1]
        if cursor.pgresult is not None and cursor.pgresult.nfields:
            formats.append(cursor.pgresult.fformat(0))

    every_kind = sa.text(
        "SELECT 9007199254740993::bigint, 'é'::varchar, '\\x00ff'::bytea, 0.1::float8, "
        "NULL::text, 3::integer, ARRAY[1, 2]::bigint[]"
    )
    with engine.connect() as conn:
        as_text = conn.execute(every_kind).one()
        as_binary = conn.execute(every_kind, execution_options={BINARY_ROWS: True}).one()
        assert formats == [TEXT, BINARY]
        assert tuple(as_binary) == tuple(as_text)
        assert [type(v) for v in as_binary] == [type(v) for v in as_text]
        formats.clear()
        published(driver, conn, "binary-1", START)
        [claimed] = driver.claim_messages(
            conn, owner="r", now=START, lease=30, limit=10, budget=3, destinations=["orders"]
        )
        assert (claimed.reply_id, claimed.body) == ("binary-1", b'{"n":1}')
        assert formats[-1] == BINARY
