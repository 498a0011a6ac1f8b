"""MySQL and MariaDB URLs: the mysql extra's driver where none is named, an explicit sync
driver kept, an async one's database on the extra's driver, and a missing package named."""

from __future__ import annotations

import sys

import pytest
import sqlalchemy as sa

from outbox.db.dialect import create_engine, make_url
from outbox.drivers import DRIVERS, driver_for_url
from outbox.errors import ConfigError


@pytest.mark.parametrize(
    ("given", "own"),
    [
        ("mysql://u@db/app", "mysql+pymysql://u@db/app"),
        ("mariadb://u@db/app", "mariadb+pymysql://u@db/app"),
        ("mysql+pymysql://u@db/app", "mysql+pymysql://u@db/app"),
        ("mysql+mysqldb://u@db/app", "mysql+mysqldb://u@db/app"),
        ("mariadb+mariadbconnector://u@db/app", "mariadb+mariadbconnector://u@db/app"),
        ("mysql+asyncmy://u@db/app?charset=utf8mb4", "mysql+pymysql://u@db/app?charset=utf8mb4"),
        ("mysql+aiomysql://u@db/app", "mysql+pymysql://u@db/app"),
    ],
)
def test_the_toolkits_own_engines_url(given: str, own: str) -> None:
    assert driver_for_url(given) is DRIVERS["mysql"]
    assert make_url(given).render_as_string() == own


def test_the_own_engine_is_read_committed_in_utf8mb4() -> None:
    engine = create_engine("mariadb://u@db/app")
    try:
        assert engine.dialect.name == "mariadb"
        options = DRIVERS["mysql"].engine_options(sa.make_url("mysql+pymysql://u@db/app"))
        assert options["isolation_level"] == "READ COMMITTED"
        assert options["connect_args"]["charset"] == "utf8mb4"
        kept = DRIVERS["mysql"].engine_options(sa.make_url("mysql+pymysql://u@db/app?charset=utf8"))
        assert "charset" not in kept["connect_args"]
    finally:
        engine.dispose()


def test_a_missing_driver_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pymysql", None)  # makes `import pymysql` fail
    with pytest.raises(ConfigError, match=r"pip install 'outbox-relay\[mysql\]'"):
        create_engine("mysql://u@db/app")


@pytest.mark.parametrize(
    ("url", "said"),
    [
        (
            "mysql+mysqldb://u@db/app",
            "database driver 'mysql+mysqldb' needs the Python module 'MySQLdb', which is not "
            "installed (a plain mysql:// URL runs on the toolkit's own)",
        ),
        ("mysql+nosuch://u@db/app", "no database driver is named 'mysql+nosuch'"),
    ],
)
def test_a_dbapi_the_url_names_that_cannot_load_is_one_clear_error(
    url: str, said: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "MySQLdb", None)  # mysqlclient absent, installed or not
    with pytest.raises(ConfigError) as raised:
        create_engine(url)
    assert str(raised.value) == said


def test_an_installed_dbapi_that_fails_to_import_is_named_with_its_reason(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broken() -> None:
        raise ImportError("libmysqlclient.so.21: cannot open shared object file")

    from sqlalchemy.dialects.mysql.mysqldb import MySQLDialect_mysqldb

    monkeypatch.setattr(MySQLDialect_mysqldb, "import_dbapi", classmethod(lambda cls: broken()))
    with pytest.raises(ConfigError) as raised:
        create_engine("mysql+mysqldb://u@db/app")
    assert str(raised.value) == (
        "database driver 'mysql+mysqldb' cannot be loaded: "
        "libmysqlclient.so.21: cannot open shared object file"
    )
