"""Database cost per delivered message and per finished task: WAL, index entries, HOT updates.

Run alone: .venv/bin/python -m benchmarks.db_cost [--quick] [--before] [--setup SQL ...]

Three windows on fresh PostgreSQL databases, each opened by a CHECKPOINT
(benchmarks.wal_window says how WAL is attributed):
- message: 2 relays (batch mode) deliver N prefilled messages to the reference
  receiver, whose receipts go to a second fresh database, so the outbox side
  (claim, settle) and the receiver's side are counted apart;
- task: Workers drain N prefilled no-op tasks (claim, finish with its reply);
- renewal: K claimed tasks have their leases renewed R times each, as a Worker's
  heartbeat renews every running lease (in the message window's outbox database,
  whose tasks table the drain left untouched).

Figures are per delivered message, per finished task and per renewal: WAL
record bytes without full-page images (`*_wal_bytes`), full-page image bytes
after the checkpoint (`*_fpi_bytes`), B-tree entries written (`*_index_entries`;
a non-HOT update writes one in every index whose predicate the new row
matches), and per table the share of updates that were HOT (in %) and how much
its heap grew. Keys with a dot break a figure down by table, index or WAL record
kind. `--setup` runs SQL on each fresh outbox database before its prefill (say,
a fillfactor to try); `--before` sets the storage back to what it was before the
migrations made for these figures (BEFORE_STORAGE), the suite's baseline.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Sequence

import outbox
from benchmarks.relay_bench import drain_backlog, fresh_database, log, prefill
from benchmarks.task_throughput import (
    CONCURRENCY,
    WORKERS,
    check_done,
    our_consumer,
    prefill_tasks,
    task_taken,
    tasks_left,
    timed_drain,
)
from benchmarks.wal_window import Database, Window, observe
from outbox.claim import Claim
from outbox.tasks import TaskQueue

RELAYS, BATCH = 2, 1000  # as the suite's drain
LEASE = 30.0

Run = dict[str, float]

# The storage as it was before the migrations that changed it for cost, applied to a fresh
# database as a `--setup`: the baseline the suite measures our figures against.
BEFORE_STORAGE = (
    # o0009: no room left on outbox_messages pages.
    "ALTER TABLE outbox_messages RESET (fillfactor)",
    # o0011: none on outbox_tasks pages either, and lease_until indexed.
    "ALTER TABLE outbox_tasks RESET (fillfactor)",
    "CREATE INDEX ix_outbox_tasks_lease ON outbox_tasks (lease_until) WHERE state = 'running'",
)


def sizes(quick: bool) -> tuple[int, int, int, int]:
    """(messages drained, tasks drained, tasks renewed, renewals of each)."""
    return (1_000, 300, 50, 3) if quick else (20_000, 5_000, 500, 5)


def apply(url: str, setup: Sequence[str]) -> None:
    """Run the `--setup` statements on a fresh outbox database."""
    if not setup:
        return
    engine = outbox.create_engine(url)
    try:
        with engine.begin() as conn:
            for statement in setup:
                conn.exec_driver_sql(statement)
    finally:
        engine.dispose()


# --- the windows ---------------------------------------------------------------------------


def message_windows(
    total: int, held: int, rounds: int, setup: Sequence[str]
) -> tuple[Window, Window]:
    """(a relay drain of `total` prefilled messages, outbox and receiver apart; then lease
    renewals on the same outbox database: see renewal_window)."""
    with fresh_database() as url, fresh_database() as receiver_url:
        apply(url, setup)
        prefill(url, total)
        log(f"  drain {total:,} messages ({RELAYS} relays, receipts in a database of their own)")

        def work() -> None:
            result = drain_backlog(url, total, "batch", RELAYS, BATCH, receiver_url=receiver_url)
            if not result["complete"]:
                raise RuntimeError(f"the relays did not drain: {result}")

        drained = observe({"outbox": url, "receiver": receiver_url}, work)
        # The tasks table is untouched by the drain: a fresh one for the renewals.
        return drained, renewal_window(url, held, rounds)


def task_window(total: int, setup: Sequence[str]) -> Window:
    """What Workers draining `total` prefilled no-op tasks wrote."""
    with fresh_database() as url:
        apply(url, setup)
        prefill_tasks(url, total)
        log(f"  drain {total:,} tasks ({WORKERS} workers x {CONCURRENCY})")

        def work() -> None:
            engine = outbox.create_engine(url)
            try:
                timed_drain(
                    our_consumer,
                    (url, CONCURRENCY, "threads"),
                    WORKERS,
                    lambda: task_taken(engine),
                    lambda: tasks_left(engine),
                )
            finally:
                engine.dispose()

        window = observe({"outbox": url}, work)
        engine = outbox.create_engine(url)
        try:
            check_done(engine, total)
        finally:
            engine.dispose()
    return window


def renewal_window(url: str, held: int, rounds: int) -> Window:
    """What `rounds` renewals of each of `held` claimed leases wrote (a heartbeat's work)."""
    prefill_tasks(url, held)
    with TaskQueue(url, lease=LEASE) as queue:
        claims = queue.claim_many("bench-renewer", held, reconcile=False)
    if len(claims) != held:
        raise RuntimeError(f"claimed {len(claims)} of {held} tasks")
    log(f"  renew {held} leases {rounds} times")

    def work() -> None:
        nonlocal claims
        with TaskQueue(url, lease=LEASE) as queue:
            for _ in range(rounds):
                # As a Worker's heartbeat renews them: every held lease in one statement.
                renewed = queue.renew_many(claims)
                claims = [claim for claim in renewed if isinstance(claim, Claim)]
                if len(claims) != held:
                    raise RuntimeError(f"renewed {len(claims)} of {held} leases")

    return observe({"outbox": url}, work)


# --- figures ---------------------------------------------------------------------------------


def hot_share(counters: dict[str, int]) -> float:
    """The HOT share of a table's updates in %, or -1 when it had none."""
    updated = counters.get("updated", 0)
    return round(100 * counters.get("hot_updated", 0) / updated, 1) if updated else -1.0


def database_figures(prefix: str, database: Database, per: int) -> Run:
    """A database's figures per unit of work: totals, then by table, index and record kind."""
    tables = database.tables.values()
    figures = {
        f"{prefix}_wal_bytes": sum(t.bytes for t in tables) / per,
        f"{prefix}_fpi_bytes": sum(t.fpi_bytes for t in tables) / per,
        f"{prefix}_wal_records": sum(t.records for t in tables) / per,
        f"{prefix}_index_entries": sum(t.index_entries for t in tables) / per,
    }
    for name, table in sorted(database.tables.items()):
        figures |= {
            f"{prefix}.{name}.wal_bytes": table.bytes / per,
            f"{prefix}.{name}.fpi_bytes": table.fpi_bytes / per,
            f"{prefix}.{name}.index_entries": table.index_entries / per,
            f"{prefix}.{name}.moved_updates": table.moved_updates / per,
        }
        for kind, (count, size) in sorted(table.kinds.items()):
            figures[f"{prefix}.{name}.{kind}.records"] = count / per
            figures[f"{prefix}.{name}.{kind}.bytes"] = size / per
    for name, index in sorted(database.indexes.items()):
        figures[f"{prefix}.index.{name}.entries"] = index.index_entries / per
    for name, counters in sorted(database.counters.items()):
        if any(counters.values()):
            figures[f"{prefix}.{name}.updates"] = counters["updated"] / per
            figures[f"{prefix}.{name}.hot_pct"] = hot_share(counters)
            figures[f"{prefix}.{name}.heap_growth_bytes"] = counters["heap_bytes"] / per
    return figures


def window_figures(prefix: str, window: Window, per: int) -> Run:
    """Every database's figures and the cluster's (everything the server wrote meanwhile)."""
    figures: Run = {}
    for label, database in window.databases.items():
        figures |= database_figures(f"{prefix}_{label}", database, per)
    figures |= {f"{prefix}_cluster_{key}": value / per for key, value in window.cluster.items()}
    return {key: round(value, 2) for key, value in figures.items()}


def run(quick: bool, setup: Sequence[str] = ()) -> Run:
    """One run: the message, task and renewal windows on fresh databases."""
    messages, tasks, held, rounds = sizes(quick)
    figures: Run = {"messages": messages, "tasks": tasks, "renewals": held * rounds}
    log("database cost of a relay drain, then of lease renewals")
    drained, renewed = message_windows(messages, held, rounds, setup)
    figures |= window_figures("message", drained, messages)
    figures |= window_figures("renewal", renewed, held * rounds)
    log("database cost of a task drain")
    figures |= window_figures("task", task_window(tasks, setup), tasks)
    log(
        f"  per message: {figures['message_outbox_wal_bytes']:,.0f} WAL bytes "
        f"(+{figures['message_outbox_fpi_bytes']:,.0f} FPI), "
        f"{figures['message_outbox_index_entries']:.2f} index entries, "
        f"HOT {figures.get('message_outbox.outbox_messages.hot_pct')}%; receiver "
        f"{figures['message_receiver_wal_bytes']:,.0f} WAL bytes"
    )
    log(
        f"  per task: {figures['task_outbox_wal_bytes']:,.0f} WAL bytes "
        f"(+{figures['task_outbox_fpi_bytes']:,.0f} FPI), "
        f"{figures['task_outbox_index_entries']:.2f} index entries, "
        f"HOT {figures.get('task_outbox.outbox_tasks.hot_pct')}%"
    )
    log(
        f"  per renewal: {figures['renewal_outbox_wal_bytes']:,.0f} WAL bytes, "
        f"{figures['renewal_outbox_index_entries']:.2f} index entries, "
        f"HOT {figures.get('renewal_outbox.outbox_tasks.hot_pct')}%"
    )
    return figures


def main(argv: Iterable[str] | None = None) -> int:
    """Run once and print the figures as JSON."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.db_cost")
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    parser.add_argument(
        "--before",
        action="store_true",
        help="the storage before migrations o0009 and o0011 (the suite's baseline)",
    )
    parser.add_argument(
        "--setup",
        action="append",
        default=[],
        metavar="SQL",
        help="a statement run on each fresh outbox database before its prefill (repeatable)",
    )
    args = parser.parse_args(None if argv is None else list(argv))
    setup = [*(BEFORE_STORAGE if args.before else ()), *args.setup]
    print(json.dumps(run(args.quick, setup)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
