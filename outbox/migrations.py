"""Schema versions: apply the Alembic migrations and refuse to run on an older schema."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import sqlalchemy as sa
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.script.revision import RevisionError
from sqlalchemy.engine import Engine

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


def upgrade_branch(url_or_engine: str | sa.URL | Engine, branch: str) -> None:
    """Apply every migration of `branch` (outbox or receiver) up to its head."""
    engine, owned = engine_for(url_or_engine)
    try:
        with engine.begin() as connection:
            command.upgrade(alembic_config(connection), f"{branch}@head")
    finally:
        if owned:
            engine.dispose()


def upgrade(url_or_engine: str | sa.URL | Engine) -> None:
    """Create or upgrade the outbox tables, as `outbox db upgrade` does."""
    upgrade_branch(url_or_engine, OUTBOX_BRANCH)


def required_head(branch: str) -> str:
    """The newest revision of `branch` this code was written for."""
    script = ScriptDirectory.from_config(alembic_config())
    revision = script.get_revision(f"{branch}@head")
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
    script = ScriptDirectory.from_config(alembic_config())
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
