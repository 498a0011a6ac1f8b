"""What a piece of work wrote to PostgreSQL: WAL per database and relation, and row updates.

The server's WAL is shared by every database on it, and other work may run
beside a benchmark, so the LSN distance and pg_stat_wal of a window count
everything the cluster wrote. The records themselves name the database and
relation they touch: pg_walinspect reads the window's records back and each
is attributed to its database and relation (a commit record to the database
its transaction wrote in). A temporary replication slot keeps the window's
WAL until it has been read, and the window opens with a CHECKPOINT, so the
full-page images in it are those of the first touch of each page after one;
they are counted apart from the records.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa

IDLE_DEADLINE_SECONDS = 60.0

# One pass over the window's WAL. A record's first block reference names its database
# and relation file; records without one (commits) take the database of their
# transaction's other records. A B-tree entry is a leaf insert, a posting-list insert,
# or the new item a leaf split places (its description starts "level 0" or "level: 0").
RECORDS_BY_RELATION = sa.text(
    """
    WITH r AS MATERIALIZED (
        SELECT xid::text::bigint AS xid, resource_manager AS rm, record_type AS rt,
               record_length, fpi_length, description, block_ref,
               substring(block_ref FROM 'rel \\d+/(\\d+)/\\d+')::oid AS db,
               substring(block_ref FROM 'rel \\d+/\\d+/(\\d+)')::oid AS node
        FROM pg_get_wal_records_info(CAST(:start AS pg_lsn), CAST(:end AS pg_lsn))
    ), xact_db AS (
        SELECT DISTINCT xid, db FROM r WHERE db IS NOT NULL AND xid <> 0
    )
    SELECT COALESCE(r.db, x.db) AS db, r.node, r.rm || '/' || r.rt AS kind,
           count(*) AS records,
           sum(r.record_length - r.fpi_length) AS bytes,
           sum(r.fpi_length) AS fpi_bytes,
           count(*) FILTER (WHERE r.fpi_length > 0) AS fpi_records,
           count(*) FILTER (
               WHERE r.rm = 'Heap' AND r.rt LIKE 'UPDATE%' AND r.block_ref LIKE '%blkref #1:%'
           ) AS moved_updates,
           count(*) FILTER (
               WHERE r.rm = 'Btree' AND (
                   r.rt IN ('INSERT_LEAF', 'INSERT_POST')
                   OR (r.rt LIKE 'SPLIT_%' AND r.description ~ '^level:? 0\\M')
               )
           ) AS index_entries
    FROM r LEFT JOIN xact_db AS x ON r.db IS NULL AND r.xid = x.xid
    WHERE COALESCE(r.db, x.db) = ANY(CAST(:dbs AS oid[]))
    GROUP BY 1, 2, 3
    """
)
# Each relation file of a database: its owning table (an index's or a TOAST table's
# owner) and whether it is an index.
RELATION_FILES = sa.text(
    """
    SELECT pg_relation_filenode(c.oid) AS node, c.relname, c.relkind,
           COALESCE(owner.relname, toast_owner.relname, c.relname) AS table_name
    FROM pg_class AS c
    LEFT JOIN pg_index AS i ON i.indexrelid = c.oid
    LEFT JOIN pg_class AS indexed ON indexed.oid = i.indrelid
    LEFT JOIN pg_class AS owner ON owner.oid = COALESCE(
        (SELECT t.oid FROM pg_class AS t WHERE t.reltoastrelid = indexed.oid), indexed.oid
    )
    LEFT JOIN pg_class AS toast_owner ON toast_owner.reltoastrelid = c.oid
    WHERE pg_relation_filenode(c.oid) IS NOT NULL
    """
)
TABLE_COUNTERS = sa.text(
    "SELECT relname, n_tup_ins, n_tup_upd, n_tup_hot_upd, n_tup_del, "
    "pg_relation_size(relid) AS heap_bytes FROM pg_stat_user_tables"
)
CLUSTER_POINT = sa.text(
    "SELECT pg_current_wal_flush_lsn()::text, wal_records, wal_fpi, wal_bytes FROM pg_stat_wal"
)
OTHER_BACKENDS = sa.text(
    "SELECT count(*) FROM pg_stat_activity "
    "WHERE datname = ANY(CAST(:names AS text[])) AND pid <> pg_backend_pid()"
)


@dataclass
class Relation:
    """What a window wrote to one relation (a table with its TOAST, or one index)."""

    records: int = 0
    bytes: int = 0  # record bytes without full-page images
    fpi_bytes: int = 0
    fpi_records: int = 0
    moved_updates: int = 0  # non-HOT heap updates whose new version went to another page
    index_entries: int = 0
    kinds: dict[str, list[int]] = field(default_factory=dict)  # kind: [records, bytes]


@dataclass
class Database:
    """What a window wrote to one database: by table, by index, and its row counters."""

    tables: dict[str, Relation] = field(default_factory=lambda: defaultdict(Relation))
    indexes: dict[str, Relation] = field(default_factory=lambda: defaultdict(Relation))
    counters: dict[str, dict[str, int]] = field(default_factory=dict)


@dataclass
class Window:
    """What a piece of work wrote: per database, and the whole cluster's WAL beside it."""

    databases: dict[str, Database]
    cluster: dict[str, float]


def observe(urls: Mapping[str, str], work: Callable[[], None]) -> Window:
    """Run `work` in a window opened by a CHECKPOINT; what it wrote to each of `urls`.

    `urls` names the databases to account for (label: URL); the first one gets
    the pg_walinspect extension. `work` must close its connections to them before
    it returns: row counters are flushed when a backend exits, and the window
    waits for that.
    """
    first = next(iter(urls.values()))
    engine = sa.create_engine(first, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            conn.execute(sa.text("CREATE EXTENSION IF NOT EXISTS pg_walinspect"))
            # Held by this session alone, dropped with it: the window's WAL stays readable
            # even if a checkpoint comes before the records are read.
            conn.execute(
                sa.text("SELECT pg_create_physical_replication_slot(:name, true, true)"),
                {"name": f"wal_window_{uuid.uuid4().hex[:12]}"},
            )
            before = {label: table_counters(url) for label, url in urls.items()}
            conn.execute(sa.text("CHECKPOINT"))
            start = conn.execute(CLUSTER_POINT).one()
            work()
            wait_idle(conn, [sa.make_url(url).database or "" for url in urls.values()])
            end = conn.execute(CLUSTER_POINT).one()
            oids = database_oids(conn, urls)
            rows = conn.execute(
                RECORDS_BY_RELATION, {"start": start[0], "end": end[0], "dbs": list(oids.values())}
            ).all()
            distance = conn.execute(
                sa.text("SELECT pg_wal_lsn_diff(CAST(:end AS pg_lsn), CAST(:start AS pg_lsn))"),
                {"start": start[0], "end": end[0]},
            ).scalar_one()
    finally:
        engine.dispose()
    databases = {}
    for label, url in urls.items():
        database = attribute([row for row in rows if row.db == oids[label]], relation_files(url))
        after = table_counters(url)
        database.counters = {
            table: {
                key: value - before[label].get(table, {}).get(key, 0) for key, value in c.items()
            }
            for table, c in after.items()
        }
        databases[label] = database
    cluster = {
        "lsn_bytes": float(distance),
        "wal_records": float(end[1] - start[1]),
        "wal_fpi": float(end[2] - start[2]),
        "wal_bytes": float(end[3] - start[3]),
    }
    return Window(databases, cluster)


def attribute(rows: list[Any], files: dict[int, tuple[str, str, bool]]) -> Database:
    """Sum the window's record rows of one database by table and by index."""
    database = Database()
    for row in rows:
        # A file the catalog no longer names (a table dropped since) is reported by number.
        relname, table, is_index = files.get(row.node, (f"file {row.node}", "(other)", False))
        if row.node is None:
            relname, table, is_index = "(commits)", "(commits)", False
        targets = [database.tables[table]] + ([database.indexes[relname]] if is_index else [])
        for target in targets:
            target.records += row.records
            target.bytes += int(row.bytes)
            target.fpi_bytes += int(row.fpi_bytes)
            target.fpi_records += row.fpi_records
            target.moved_updates += row.moved_updates
            target.index_entries += row.index_entries
            count, size = target.kinds.get(row.kind, [0, 0])
            target.kinds[row.kind] = [count + row.records, size + int(row.bytes)]
    return database


def database_oids(conn: sa.Connection, urls: Mapping[str, str]) -> dict[str, int]:
    """The oid of each labelled database."""
    names = {label: sa.make_url(url).database or "" for label, url in urls.items()}
    rows = conn.execute(sa.text("SELECT datname, oid FROM pg_database")).tuples().all()
    found: dict[str, int] = dict(rows)
    return {label: int(found[name]) for label, name in names.items()}


def relation_files(url: str) -> dict[int, tuple[str, str, bool]]:
    """Each relation file of a database: (relation name, owning table, whether an index)."""
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(RELATION_FILES).all()
    finally:
        engine.dispose()
    return {int(row.node): (row.relname, row.table_name, row.relkind == "i") for row in rows}


def table_counters(url: str) -> dict[str, dict[str, int]]:
    """Rows inserted, updated, HOT-updated and deleted so far, and heap size, per user table."""
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(TABLE_COUNTERS).all()
    finally:
        engine.dispose()
    return {
        row.relname: {
            "inserted": row.n_tup_ins,
            "updated": row.n_tup_upd,
            "hot_updated": row.n_tup_hot_upd,
            "deleted": row.n_tup_del,
            "heap_bytes": row.heap_bytes,
        }
        for row in rows
    }


def wait_idle(conn: sa.Connection, names: list[str]) -> None:
    """Wait until no other backend is connected to the named databases (their counters are
    flushed when they exit)."""
    deadline = time.monotonic() + IDLE_DEADLINE_SECONDS
    pause = threading.Event()
    while conn.execute(OTHER_BACKENDS, {"names": names}).scalar_one():
        if time.monotonic() > deadline:
            raise RuntimeError(f"backends still connected to {names} after the work ended")
        pause.wait(0.05)
