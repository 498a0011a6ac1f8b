"""publish() on MySQL inside the host's own transaction: a Session of the application's
engine (its own isolation level), and an AsyncSession on asyncmy through outbox.asyncio.

A duplicate key undoes only its statement (outbox.drivers.mysql.once): a second publish
of the same reply_id in the caller's transaction finds the first and the transaction
goes on; a rollback of the caller's transaction takes the message back.
"""

from __future__ import annotations

import asyncio

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session
from support.async_urls import through

import outbox
import outbox.asyncio
from outbox import PayloadCollision
from outbox.schema import messages

pytestmark = pytest.mark.parametrize("backend", ["mysql"], indirect=True)


def stored(engine: sa.Engine) -> dict[str, bytes]:
    """Each stored message's body, by reply_id."""
    with engine.connect() as conn:
        return {r.reply_id: bytes(r.body) for r in conn.execute(sa.select(messages))}


def test_publish_joins_a_session_of_the_applications_engine(db_url: str, engine: sa.Engine) -> None:
    host = sa.create_engine(db_url)  # the application's: REPEATABLE READ, the server's default
    try:
        with Session(host) as session:
            with session.begin():
                outbox.publish(session, "billing", "gone", {"n": 1})
                session.rollback()
            with session.begin():
                first = outbox.publish(session, "billing", "kept", {"n": "é"})
                again = outbox.publish(session, "billing", "kept", {"n": "é"})
                assert again["id"] == first["id"]
                with pytest.raises(PayloadCollision):
                    outbox.publish(session, "billing", "kept", {"n": 2})
    finally:
        host.dispose()
    assert stored(engine) == {"kept": '{"n":"é"}'.encode()}


def test_asyncio_publish_joins_an_asyncmy_session(db_url: str, engine: sa.Engine) -> None:
    url = through(db_url, "mysql+asyncmy")

    async def scenario() -> None:
        async_engine = create_async_engine(url)
        try:
            async with AsyncSession(async_engine) as session:
                async with session.begin():
                    await outbox.asyncio.publish(session, "billing", "gone", {"n": 1})
                    await session.rollback()
                async with session.begin():
                    first = await outbox.asyncio.publish(session, "billing", "kept", {"n": 2})
                    again = await outbox.asyncio.publish(session, "billing", "kept", {"n": 2})
                    assert again["id"] == first["id"]
        finally:
            await async_engine.dispose()

    asyncio.run(scenario())
    assert stored(engine) == {"kept": b'{"n":2}'}


@pytest.mark.parametrize("returning", [True, False], ids=["MariaDB RETURNING", "MySQL read-back"])
def test_a_new_message_comes_back_the_same_with_or_without_returning(
    db_url: str, engine: sa.Engine, returning: bool
) -> None:
    host = sa.create_engine(db_url)
    host.connect().close()  # the dialect learns the server's features at the first connect
    # MySQL 8 has no INSERT ... RETURNING: its path, the read by id, runs here on MariaDB.
    host.dialect.insert_returning = returning
    seen: list[str] = []
    sa.event.listen(host, "before_cursor_execute", lambda *args: seen.append(args[2]))
    try:
        with Session(host) as session, session.begin():
            row = dict(outbox.publish(session, "billing", "one", {"n": 1}, ordering_key="k"))
    finally:
        host.dispose()
    with engine.connect() as conn:
        stored_row = conn.execute(sa.select(messages)).mappings().one()
    assert row["id"] == stored_row["id"]
    assert (row["reply_id"], row["ordering_key"], row["state"]) == ("one", "k", "pending")
    assert row["available_at"] == stored_row["available_at"]
    written = [s for s in seen if s.lstrip().upper().startswith(("INSERT", "SELECT"))]
    assert len(written) == (1 if returning else 2), written
