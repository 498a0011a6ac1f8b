"""Fixtures: every store test runs on SQLite, PostgreSQL and MySQL or MariaDB.

Each run gets its own PostgreSQL and MySQL databases (dropped at the end) and each test
starts from empty tables; SQLite tests get a fresh copy of a migrated file.
Under CI=true a PostgreSQL or MariaDB that cannot be reached fails the run.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import sqlalchemy as sa
from support.environment import EMPTYING_SESSION, IN_CI, empty_tables
from support.nats_helpers import store_kept

import outbox
import receiver
from outbox import TaskQueue
from outbox.testing import ManualClock

PG_ADMIN_URL = os.environ.get(
    "OUTBOXDEV_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)
# Without TLS, which the local MariaDB does not offer: PyMySQL 1.2 otherwise prepares it
# for every connection, loading the system's CA store (21 ms of CPU each here), which
# was half the CPU of the suite's runs on MariaDB. support.async_urls drops the key for
# the async DBAPIs, which do not take it.
MYSQL_ADMIN_URL = os.environ.get(
    "OUTBOXDEV_TEST_MYSQL_URL", "mysql+pymysql://root@127.0.0.1:3306/mysql?ssl_disabled=true"
)
START = 1_000_000.0


def pytest_addoption(parser: pytest.Parser) -> None:
    """`--soak`: fault scenarios run their long form (100+ runs per failpoint)."""
    parser.addoption(
        "--soak",
        action="store_true",
        default=False,
        help="run the fault scenarios in their long form (tests/faults)",
    )


LONGEST_FIRST = (
    "tests/test_benchmarks_smoke.py",
    "tests/faults/test_soak.py",
    "tests/faults/test_model.py",
)
"""Tests of a minute or more, started first: begun last, one would run on alone at the end
of a parallel run while the other workers sit idle."""


FAULTS = "tests/faults/"
"""The fault proofs: real processes killed, cut off and stalled. Marked `faults`, they run
as `make test-faults`, .ci/run's step after the browser tests, so the default suite
stays quick."""


BROWSER = (
    "tests/console/test_console_browser.py",
    "tests/console/test_console_story.py",
    "tests/console/test_console_accessibility.py",
)
"""The console driven in headless Chromium, against real processes: marked `browser`, run by
`make test-browser` beside `make test`, whose six minutes they would take a minute of."""
PROCESSES = (
    "tests/relay/test_relay_receiver.py",
    "tests/relay/test_relay_process.py",
    "tests/receiver/test_receiver_process.py",
    "tests/receiver/test_receiver_limits.py",
    "tests/receiver/test_receiver_protocol.py",
    "tests/receiver/test_receiver_concurrency.py",
    "tests/receiver/test_receiver_observability.py",
    "tests/test_stop_signals.py",
    "tests/test_worker_observability.py",
    "tests/test_failpoint_environment.py",
    "tests/test_tracing_processes.py",
    "tests/test_cli_processes.py",
    "tests/test_trace_cost.py",
    "tests/test_receipts_receiver.py",
)
"""Tests that start the product's own processes (receivers, relays, workers, consoles) and
talk to them over real sockets and signals: a third of the suite's time, mostly spent
waiting for processes to start and stop, which a busy machine stretches most. Marked
`processes`, they run as `make test-processes`, .ci/run's step right after `make test`, so
that `make test` keeps its six minutes at any hour. The first-contact tests that start
processes (the README's quickstart, the demo, the plain install, the examples) stay in
`make test`."""
MYSQL_ONLY = "tests/drivers/test_mysql_"
"""The driver tests of MySQL alone (InnoDB's locking, plans, sessions, URLs): marked
`mysql` with the rest of MariaDB's runs, which `make test-mysql` runs alone."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark the fault proofs, MYSQL_ONLY, BROWSER and PROCESSES; run LONGEST_FIRST first, longest
    first; the rest as collected."""
    for item in items:
        if item.nodeid.startswith(FAULTS):
            item.add_marker(pytest.mark.faults)
        if item.nodeid.startswith(MYSQL_ONLY):
            item.add_marker(pytest.mark.mysql)
        if item.nodeid.startswith(BROWSER):
            item.add_marker(pytest.mark.browser)
        if item.nodeid.startswith(PROCESSES):
            item.add_marker(pytest.mark.processes)

    def rank(item: pytest.Item) -> int:
        for place, prefix in enumerate(LONGEST_FIRST):
            if item.nodeid.startswith(prefix):
                return place
        return len(LONGEST_FIRST)

    items.sort(key=rank)


@pytest.fixture(scope="session", autouse=True)
def nats_store_kept() -> Iterator[None]:
    """The shared NATS server's store directory kept for the run (support.nats_helpers)."""
    with store_kept():
        yield


@pytest.fixture(scope="session")
def soak(request: pytest.FixtureRequest) -> bool:
    """Whether the fault scenarios run in their long form."""
    return bool(request.config.getoption("--soak"))


def upgrade_all(url: str) -> None:
    """Apply both migration branches."""
    outbox.upgrade(url)
    receiver.upgrade(url)


@contextmanager
def admin_engine(url: str, server: str) -> Iterator[sa.Engine]:
    """An autocommit engine on a local `server`; fails under CI, skips elsewhere, when
    unreachable."""
    engine = sa.create_engine(url, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            conn.execute(sa.text("select 1"))
    except sa.exc.OperationalError as exc:
        engine.dispose()
        if IN_CI:
            pytest.fail(f"{server} is required under CI=true and is unreachable: {exc}")
        pytest.skip(f"{server} unreachable at {url}")
    try:
        yield engine
    finally:
        engine.dispose()


@pytest.fixture(scope="session")
def pg_server() -> Iterator[sa.Engine]:
    """An admin engine on the local PostgreSQL."""
    with admin_engine(PG_ADMIN_URL, "PostgreSQL") as engine:
        yield engine


@pytest.fixture(scope="session")
def pg_empty_database(pg_server: sa.Engine) -> Iterator[str]:
    """A fresh, empty database for this run (and this xdist worker), dropped at the end."""
    name = f"outbox_test_{uuid.uuid4().hex[:12]}"
    with pg_server.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    url = sa.make_url(PG_ADMIN_URL).set(database=name).render_as_string(hide_password=False)
    yield url
    with pg_server.connect() as conn:
        conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.fixture
def pg_blank_url(pg_server: sa.Engine) -> Iterator[str]:
    """An empty PostgreSQL database of this test's own (for tests that migrate), dropped after."""
    name = f"outbox_mig_{uuid.uuid4().hex[:12]}"
    with pg_server.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    yield pg_server.url.set(database=name).render_as_string(hide_password=False)
    with pg_server.connect() as conn:
        conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.fixture
def pg_psycopg_url(pg_blank_url: str) -> str:
    """A PostgreSQL database of this test's own, both branches migrated, named with the
    psycopg driver (the benchmarks' COPY and bare relays need it)."""
    url = sa.make_url(pg_blank_url).set(drivername="postgresql+psycopg").render_as_string(False)
    upgrade_all(url)
    return url


@pytest.fixture(scope="session")
def pg_database(pg_empty_database: str) -> str:
    """The run's PostgreSQL database with both branches migrated."""
    upgrade_all(pg_empty_database)
    return pg_empty_database


@pytest.fixture(scope="session")
def mysql_server() -> Iterator[sa.Engine]:
    """An admin engine on the local MySQL or MariaDB."""
    with admin_engine(MYSQL_ADMIN_URL, "MariaDB") as engine:
        yield engine


@contextmanager
def mysql_scratch_database(server: sa.Engine, prefix: str) -> Iterator[str]:
    """A new, empty MySQL database named `prefix` and a random suffix, dropped at the end."""
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    with server.connect() as conn:
        # The server's default collation, case-insensitive: the tables bring their own.
        conn.execute(sa.text(f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4"))
    try:
        yield server.url.set(database=name).render_as_string(hide_password=False)
    finally:
        with server.connect() as conn:
            conn.execute(sa.text(f"DROP DATABASE IF EXISTS `{name}`"))


@pytest.fixture(scope="session")
def mysql_database(mysql_server: sa.Engine) -> Iterator[str]:
    """The run's (and this xdist worker's) MySQL database with both branches migrated."""
    with mysql_scratch_database(mysql_server, "outbox_test") as url:
        upgrade_all(url)
        yield url


@pytest.fixture
def mysql_blank_url(mysql_server: sa.Engine) -> Iterator[str]:
    """An empty MySQL database of this test's own (for tests that migrate), dropped after."""
    with mysql_scratch_database(mysql_server, "outbox_mig") as url:
        yield url


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A migrated SQLite file that each test copies."""
    path = tmp_path_factory.mktemp("template") / "template.db"
    upgrade_all(f"sqlite:///{path}")
    return path


# MariaDB's runs are marked `mysql`, to be run alone (`make test-mysql`) after a change to
# the MySQL driver; `make test` and the steps after it run them with the rest.
@pytest.fixture(params=["sqlite", "postgresql", pytest.param("mysql", marks=pytest.mark.mysql)])
def backend(request: pytest.FixtureRequest) -> str:
    """The backend under test."""
    return str(request.param)


@pytest.fixture(scope="session")
def emptying_engines() -> Iterator[dict[str, sa.Engine]]:
    """One engine per server database that empties it between tests, kept for the run: a
    new connection cost the server 4 ms of CPU for each test (PostgreSQL's)."""
    engines: dict[str, sa.Engine] = {}
    yield engines
    for engine in engines.values():
        engine.dispose()


@pytest.fixture
def db_url(
    backend: str,
    request: pytest.FixtureRequest,
    tmp_path: Path,
    emptying_engines: dict[str, sa.Engine],
) -> str:
    """A migrated, empty database on the current backend."""
    if backend == "sqlite":
        path = tmp_path / "test.db"
        shutil.copyfile(request.getfixturevalue("sqlite_template"), path)
        return f"sqlite:///{path}"
    url: str = request.getfixturevalue("mysql_database" if backend == "mysql" else "pg_database")
    if url not in emptying_engines:
        # Named, for the tests that kill the other sessions of a database to leave it out.
        named = {"application_name": EMPTYING_SESSION} if backend == "postgresql" else {}
        emptying_engines[url] = sa.create_engine(
            url, pool_size=1, pool_pre_ping=True, connect_args=named
        )
    with emptying_engines[url].begin() as conn:
        empty_tables(conn, backend)
    return url


@pytest.fixture
def clock() -> ManualClock:
    """A manual clock; nothing in the tests waits for real time to pass."""
    return ManualClock(START)


@pytest.fixture
def queue(db_url: str, clock: ManualClock) -> Iterator[TaskQueue]:
    """A queue on the current backend accepting sources agent-a and agent-b."""
    q = TaskQueue(db_url, clock=clock, allowed_sources=("agent-a", "agent-b"))
    yield q
    q.close()
