"""Fixtures for relay tests: a scripted HTTP peer on loopback and an engine."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from support.raw_peer import RawPeer, raw_peer
from support.scripted_server import ScriptedServer

import outbox


@pytest.fixture
def server() -> Iterator[ScriptedServer]:
    """A scripted peer on loopback."""
    with ScriptedServer() as running:
        yield running


@pytest.fixture
def engine(db_url: str) -> Iterator[sa.Engine]:
    """An engine on the test database."""
    created = outbox.create_engine(db_url)
    yield created
    created.dispose()


@pytest.fixture
def peer() -> Iterator[RawPeer]:
    """A raw TCP peer answering with the bytes a test sets."""
    with raw_peer() as running:
        yield running
