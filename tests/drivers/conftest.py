"""The conformance suite's fixtures: every registered driver, on a database of its backend.

`backend` is parametrised over outbox.drivers.DRIVERS, the only list of drivers, so a
new driver is run here as soon as it is registered (tests/conftest.py's `db_url` then
needs a per-run database of its backend). Each test runs in one transaction on the
toolkit's own engine, rolled back at the end.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from outbox.db.dialect import create_engine
from outbox.drivers import DRIVERS, Driver, driver_for


@pytest.fixture(params=sorted(DRIVERS))
def backend(request: pytest.FixtureRequest) -> str:
    """The backend of each registered driver."""
    return str(request.param)


@pytest.fixture
def engine(db_url: str) -> Iterator[sa.Engine]:
    """The toolkit's own engine on a migrated, empty database of the backend."""
    made = create_engine(db_url)
    yield made
    made.dispose()


@pytest.fixture
def driver(engine: sa.Engine, backend: str) -> Driver:
    """The driver under test, as the products choose it: by their engine."""
    chosen = driver_for(engine)
    assert chosen is DRIVERS[backend]
    return chosen


@pytest.fixture
def conn(engine: sa.Engine) -> Iterator[sa.Connection]:
    """A connection in a transaction, committed at the end (the database is emptied anyway)."""
    with engine.begin() as opened:
        yield opened
