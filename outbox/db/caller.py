"""The caller's transaction: the Connection behind a Session or Connection it hands in.

publish() and TaskQueue.receive_tx() join a transaction the caller owns and commits.
An AsyncSession or AsyncConnection cannot be driven from sync code, so one handed to a
sync function is refused with the name of its async counterpart.
"""

from __future__ import annotations

from sqlalchemy.engine import Connection
from sqlalchemy.orm import Session


def caller_connection(session: object, function: str, async_call: str) -> Connection:
    """The connection of a Session or Connection; TypeError naming `async_call` otherwise."""
    # Checked at run time: callers are not always type-checked.
    if isinstance(session, Connection):
        return session
    if isinstance(session, Session):
        return session.connection()
    hint = (
        f": {async_call} instead"
        if type(session).__name__ in ("AsyncSession", "AsyncConnection")
        else ""
    )
    raise TypeError(
        f"{function} takes a Session or a Connection, not {type(session).__name__}{hint}"
    )
