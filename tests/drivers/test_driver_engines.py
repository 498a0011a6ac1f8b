"""Engines: the URLs a driver runs on, its engine set-up, and its missing-table error."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from outbox.drivers import DRIVERS, Driver, UnsupportedDatabase, driver_for_url


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
