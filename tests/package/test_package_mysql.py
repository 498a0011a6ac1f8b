"""The mysql extra: with it, `outbox db upgrade` builds both schemas on MariaDB from a plain
`mysql://` URL; without it, the same command names the extra to install."""

from __future__ import annotations

import importlib.util
import json
import os
import uuid
from collections.abc import Callable, Iterator
from subprocess import CompletedProcess

import pytest
import sqlalchemy as sa

from outbox.migrations import OUTBOX_BRANCH, RECEIVER_BRANCH, required_head

ADMIN_URL = sa.make_url(
    os.environ.get("OUTBOXDEV_TEST_MYSQL_URL", "mysql+pymysql://root@127.0.0.1:3306/mysql")
)
"""The MariaDB (or MySQL) the check may create a database on, as the suite's conftest reads it."""
EXTRAS = os.environ.get("OUTBOXDEV_PACKAGE_EXTRAS")
"""The extras .ci/package_check.py installed in this venv; unset in the dev install."""
EXTRA_INSTALLED = (
    "mysql" in EXTRAS.split(",")
    if EXTRAS is not None
    else importlib.util.find_spec("pymysql") is not None
)
"""Whether the mysql extra is installed: as the check says, so that an extra that lost its
package fails the test with it rather than passing the one without it."""
IN_CI = os.environ.get("CI", "").lower() == "true"


@pytest.fixture
def mysql_url() -> Iterator[str]:
    """A `mysql://` URL of a new, empty database of this test's own, dropped after."""
    admin = sa.create_engine(ADMIN_URL, isolation_level="AUTOCOMMIT")
    name = f"outbox_pkg_{uuid.uuid4().hex[:12]}"
    try:
        with admin.connect() as conn:
            conn.execute(sa.text(f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4"))
    except sa.exc.OperationalError as exc:
        admin.dispose()
        if IN_CI:
            pytest.fail(f"MariaDB is required under CI=true and is unreachable: {exc}")
        pytest.skip(f"MariaDB unreachable at {ADMIN_URL}")
    try:
        # Plain `mysql://`, as a user writes it: the extra's driver is chosen for it.
        plain = ADMIN_URL.set(drivername="mysql", database=name)
        yield plain.render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f"DROP DATABASE IF EXISTS `{name}`"))
        admin.dispose()


@pytest.mark.skipif(not EXTRA_INSTALLED, reason="the mysql extra is not installed here")
def test_with_the_extra_db_upgrade_builds_both_schemas_on_a_plain_mysql_url(
    mysql_url: str, command: Callable[..., CompletedProcess[str]]
) -> None:
    done = command("db", "upgrade", "--receiver", "--json", "--db", mysql_url)
    assert done.returncode == 0, done.stdout + done.stderr
    heads = {required_head(OUTBOX_BRANCH), required_head(RECEIVER_BRANCH)}
    assert set(json.loads(done.stdout)["revisions"]) == heads
    current = command("db", "current", "--json", "--db", mysql_url)
    assert current.returncode == 0, current.stdout + current.stderr
    assert set(json.loads(current.stdout)["revisions"]) == heads


@pytest.mark.skipif(EXTRA_INSTALLED, reason="the mysql extra is installed here")
def test_without_the_extra_a_mysql_url_names_it(
    command: Callable[..., CompletedProcess[str]],
) -> None:
    done = command("db", "upgrade", "--db", "mysql://root@127.0.0.1:3306/app")
    assert done.returncode != 0
    assert "pip install 'outbox-relay[mysql]'" in done.stderr, done.stderr
