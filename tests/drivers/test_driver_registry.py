"""The registry: the only list of drivers, and how the products choose one."""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from sqlalchemy.dialects import mssql

from outbox.drivers import DRIVERS, UnsupportedDatabase, driver_for
from outbox.drivers.base import Driver


def test_every_driver_is_registered_under_its_dialect_name() -> None:
    assert sorted(DRIVERS) == ["mysql", "postgresql", "sqlite"]
    for name, driver in DRIVERS.items():
        assert driver.name == name
        assert driver_for(name) is driver


def test_a_driver_is_chosen_by_an_engine_a_connection_or_a_dialect() -> None:
    engine = sa.create_engine("sqlite://")
    with engine.connect() as conn:
        assert driver_for(conn) is DRIVERS["sqlite"]
    assert driver_for(engine) is DRIVERS["sqlite"]
    assert driver_for(engine.dialect) is DRIVERS["sqlite"]
    engine.dispose()


def test_an_unsupported_backend_is_refused_by_name() -> None:
    with pytest.raises(UnsupportedDatabase, match=r"unsupported database 'oracle'.*postgresql"):
        driver_for("oracle")
    # A ValueError, as make_url's own refusal of an unsupported URL.
    with pytest.raises(ValueError, match="mssql"):
        driver_for(mssql.dialect())


def test_something_else_is_refused_with_its_type() -> None:
    with pytest.raises(TypeError, match="not int"):
        driver_for(3)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", sorted(DRIVERS))
def test_each_driver_implements_the_whole_interface(name: str) -> None:
    driver = DRIVERS[name]
    missing = [
        member
        for member in dir(Driver)
        if not member.startswith("_") and not hasattr(driver, member)
    ]
    assert missing == []


def test_the_mariadb_dialect_runs_on_the_mysql_driver() -> None:
    # SQLAlchemy names the dialect of a mariadb:// URL "mariadb", of a mysql:// one "mysql".
    assert sa.create_engine("mariadb+pymysql://db/app").dialect.name == "mariadb"
    assert driver_for("mariadb") is DRIVERS["mysql"]
    assert driver_for(sa.create_engine("mariadb+pymysql://db/app")) is DRIVERS["mysql"]
