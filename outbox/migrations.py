"""Schema versions: apply the Alembic migrations and refuse to run on an older schema."""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import alembic.context
import alembic.op
import sqlalchemy as sa
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.script.revision import RevisionError
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from alembic import command
from outbox.db.dialect import create_engine, prepare_engine
from outbox.errors import SchemaNotReady

# Our own version table, so a host application's alembic_version is never touched.
VERSION_TABLE = "outbox_alembic_version"
OUTBOX_BRANCH = "outbox"
RECEIVER_BRANCH = "receiver"


def script_location() -> Path:
    """Where the migration scripts are: inside an installed wheel, or the source tree."""
    packaged = Path(__file__).resolve().parent / "_alembic"
    if packaged.is_dir():
        return packaged
    return Path(__file__).resolve().parent.parent / "alembic"


def engine_for(url_or_engine: str | sa.URL | Engine, **options: Any) -> tuple[Engine, bool]:
    """Return (engine, owned): an engine we created from a URL (with `options`) is ours."""
    if isinstance(url_or_engine, Engine):
        return prepare_engine(url_or_engine), False
    return create_engine(url_or_engine, **options), True


def alembic_config(connection: sa.Connection | None = None) -> Config:
    """An Alembic config pointing at our scripts, optionally bound to an open connection."""
    config = Config()
    config.set_main_option("script_location", str(script_location()))
    config.set_main_option("recursive_version_locations", "true")
    config.set_main_option("path_separator", "os")
    config.attributes["version_table"] = VERSION_TABLE
    if connection is not None:
        config.attributes["connection"] = connection
    return config


def upgrade_branch(target: str | sa.URL | Engine | Connection, branch: str) -> None:
    """Apply `branch` (outbox or receiver) up to its head: a URL or engine in a transaction of
    its own and committed, a connection in the transaction it is in (see upgrade_on)."""
    if isinstance(target, Connection):
        upgrade_on(target, branch)
        return
    if not isinstance(target, str | sa.URL | Engine):
        raise not_a_target(target)
    engine, owned = engine_for(target)
    try:
        with engine.begin() as connection:
            upgrade_on(connection, branch)
    finally:
        if owned:
            engine.dispose()


def upgrade_on(connection: Connection, branch: str) -> None:
    """Apply `branch` up to its head inside the connection's transaction; its caller commits."""
    # With no transaction open, Alembic begins one and commits it, as for any command: then
    # there is no caller's transaction to join.
    with host_context_kept():
        command.upgrade(alembic_config(connection), f"{branch}@head")


@contextmanager
def host_context_kept() -> Iterator[None]:
    """Put back Alembic's `context` and `op` proxies as they were before our nested run."""
    # Alembic installs them as module globals for the command it runs and deletes them at
    # its end: a host's env.py or migration that calls us is still running on them.
    namespaces = [vars(alembic.context), vars(alembic.op)]
    saved = [dict(namespace) for namespace in namespaces]
    try:
        yield
    finally:
        for namespace, before in zip(namespaces, saved, strict=True):
            for name in namespace.keys() - before.keys():
                del namespace[name]
            namespace.update(before)


def not_a_target(target: object) -> TypeError:
    """The error for an argument upgrade() cannot migrate, saying what to pass instead."""
    if isinstance(target, AsyncConnection):
        return TypeError(
            "upgrade() runs Alembic synchronously: on an AsyncConnection call "
            "`await conn.run_sync(outbox.upgrade)` (or receiver.upgrade)"
        )
    if isinstance(target, AsyncEngine):
        return TypeError(
            "upgrade() runs Alembic synchronously: pass the URL (async drivers are mapped "
            "to their sync driver) or `async with engine.begin() as conn: "
            "await conn.run_sync(outbox.upgrade)`"
        )
    return TypeError(
        "upgrade() takes a database URL, an Engine or an open Connection, "
        f"not {type(target).__name__}"
    )


def upgrade(target: str | sa.URL | Engine | Connection) -> None:
    """Create or upgrade the outbox tables, as `outbox db upgrade` does; on a Connection, inside
    its transaction (docs/how-to/alembic.md)."""
    upgrade_branch(target, OUTBOX_BRANCH)


@functools.cache
def shipped_scripts() -> ScriptDirectory:
    """The migration scripts shipped with this code, read once: every queue, relay and
    store checks the schema at start, and reading them took 12 ms each time."""
    script = ScriptDirectory.from_config(alembic_config())
    script.revision_map.heads  # noqa: B018 (built now, not by the first of several threads)
    return script


def required_head(branch: str) -> str:
    """The newest revision of `branch` this code was written for."""
    revision = shipped_scripts().get_revision(f"{branch}@head")
    assert revision is not None
    return revision.revision


def current_heads(connection: sa.Connection) -> tuple[str, ...]:
    """The revisions recorded in the database's version table (empty when never upgraded)."""
    context = MigrationContext.configure(connection, opts={"version_table": VERSION_TABLE})
    return tuple(context.get_current_heads())


def heads_of(url_or_engine: str | sa.URL | Engine) -> tuple[str, ...]:
    """The revisions recorded in a database, opened from a URL or an engine."""
    engine, owned = engine_for(url_or_engine)
    try:
        with engine.connect().execution_options(outbox_read_only=True) as connection:
            return current_heads(connection)
    finally:
        if owned:
            engine.dispose()


def ensure_current(engine: Engine, branch: str = OUTBOX_BRANCH) -> None:
    """Raise SchemaNotReady unless the database has `branch` at (or past) this code's head."""
    needed = required_head(branch)
    with engine.connect().execution_options(outbox_read_only=True) as connection:
        heads = current_heads(connection)
    if needed in heads:
        return
    script = shipped_scripts()
    for head in heads:
        try:
            lineage = [rev.revision for rev in script.iterate_revisions(head, "base")]
        except RevisionError as exc:
            raise SchemaNotReady(
                f"database {engine.url.render_as_string(hide_password=True)} is at revision "
                f"{head!r}, which this code does not know: run the version of this code that "
                f"wrote it"
            ) from exc
        if needed in lineage:
            return  # the database is newer than this code; newer migrations stay compatible
    where = ", ".join(heads) if heads else "no outbox schema"
    url = engine.url.render_as_string(hide_password=True)
    command_name = "outbox db upgrade" if branch == OUTBOX_BRANCH else "outbox receiver upgrade"
    raise SchemaNotReady(
        f"database {url} has {where}; this code needs {branch} revision {needed}. "
        f"Run: {command_name} --db {url}"
    )


def branch_head(heads: Iterable[str], branch: str) -> str | None:
    """The revision of `branch` among a database's `heads`, or None when it has none."""
    script = shipped_scripts()
    for head in heads:
        try:
            revision = script.get_revision(head)
        except RevisionError:
            continue  # written by a newer version of this code: not ours to name
        if revision is not None and branch in revision.branch_labels:
            return head
    return None
