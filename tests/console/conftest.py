"""Fixtures for the console's tests: a seeded database and Operations on it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from support.console_helpers import ConsoleClient, client, seed
from support.receiver_helpers import SECRET, relay_toml
from support.served import served_receiver

import outbox
from outbox.operations import Operations
from outbox.testing import ManualClock


@pytest.fixture
def engine(db_url: str) -> Iterator[sa.Engine]:
    """An engine on the test database."""
    created = outbox.create_engine(db_url)
    yield created
    created.dispose()


@pytest.fixture
def seeded(db_url: str, engine: sa.Engine, clock: ManualClock) -> str:
    """The database support.console_helpers.seed describes."""
    seed(db_url, engine, clock)
    return db_url


@pytest.fixture
def ops(seeded: str, clock: ManualClock) -> Iterator[Operations]:
    """Operations on the seeded database, on the test's clock."""
    with Operations(seeded, clock=clock) as opened:
        yield opened


@pytest.fixture
def no_relay_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """No config file or variable names the destinations, whatever the environment."""
    for name in ("OUTBOX_CONFIG", "OUTBOX_RELAY_CONFIG"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def make_client(ops: Operations) -> Iterator[Callable[..., ConsoleClient]]:
    """Makes clients on the console app over `ops` (see support.console_helpers.client);
    each is closed after the test."""
    made: list[ConsoleClient] = []

    def make(**options: Any) -> ConsoleClient:
        made.append(client(ops, **options))
        return made[-1]

    yield make
    for each in made:
        each.close()


@pytest.fixture
def relay_config(tmp_path: Path, seeded: str) -> Iterator[Path]:
    """A relay TOML whose destination "billing" is the reference receiver, with its receipt
    lookup."""
    secret_file = tmp_path / "secret"
    secret_file.write_text(SECRET + "\n", encoding="utf-8")
    with served_receiver(seeded) as served:
        yield relay_toml(tmp_path, "billing", served.base, secret_file)
