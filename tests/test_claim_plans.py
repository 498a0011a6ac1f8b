"""EXPLAIN guard: claims and batches walk the indexes they should, even as generic plans.

psycopg prepares a statement after five runs, and PostgreSQL may then switch to
a generic plan, planned without the parameters' values. A partial index whose
predicate names a bound parameter cannot be proven usable then, and the claim
would scan every finished row. These tests force the generic plan.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import sqlalchemy as sa
from psycopg import sql as psycopg_sql

from outbox.db.dialect import bound_now
from outbox.drivers import DRIVERS
from outbox.drivers.common import figures, leases, task_reconcile
from outbox.drivers.postgresql import claims, task_claims, task_renewals, task_results
from outbox.drivers.postgresql.reap import reap_recording_statement

PARAMETER = re.compile(r"%\((\w+)\)s")
PG = DRIVERS["postgresql"]
CLAIMS = PG.claim_session()
"""The setting of the relay's claims connection, which its statements' tests plan under."""
TASK_CLAIMS = task_claims.TASK_CLAIM_SESSION
"""The setting of the worker's claims connection (and of a claim inside a transaction)."""


def generic_plan(
    conn: sa.Connection,
    statement: Any,
    values: dict[str, Any],
    mode: str = "force_generic_plan",
    session: str | None = None,
    explain: str = "EXPLAIN",
) -> str:
    """EXPLAIN of `statement` as PostgreSQL plans it once for any parameter values.

    With `mode` "force_custom_plan", as it plans it for these values instead. `session`:
    the SQL that sets up the connection it runs on (the driver's claim_session), if any.
    `explain`: "EXPLAIN (ANALYZE)" runs it too, in the connection's transaction.
    """
    compiled = statement.compile(dialect=conn.dialect, compile_kwargs={"render_postcompile": True})
    order: list[str] = []

    def number(match: re.Match[str]) -> str:
        if match[1] not in order:
            order.append(match[1])
        return f"${order.index(match[1]) + 1}"

    sql = PARAMETER.sub(number, str(compiled))
    params = {**compiled.params, **values}
    types = [
        conn.dialect.type_compiler_instance.process(compiled.binds[name].type) for name in order
    ]
    arguments = [(params[name], kind) for name, kind in zip(order, types, strict=True)]
    return prepared_plan(conn, sql, arguments, mode, session, explain)


def prepared_plan(
    conn: sa.Connection,
    sql: str,
    arguments: list[tuple[Any, str]],
    mode: str,
    session: str | None = None,
    explain: str = "EXPLAIN",
) -> str:
    """EXPLAIN of `sql` (parameters $1, $2, ...) prepared, then executed with `arguments`,
    each a (value, SQL type) pair, under plan_cache_mode `mode` (see generic_plan)."""
    cursor = conn.connection.dbapi_connection.cursor()  # type: ignore[union-attr]
    try:
        if session is not None:
            cursor.execute(session)
        cursor.execute(f"SET plan_cache_mode = {mode}")
        types = ", ".join(kind for _, kind in arguments)
        cursor.execute(f"PREPARE guarded ({types}) AS {sql}")
        # Literal arguments: EXECUTE cannot infer the types of bound ones.
        literals = psycopg_sql.SQL(", ").join(
            psycopg_sql.SQL("{}::{}").format(psycopg_sql.Literal(value), psycopg_sql.SQL(kind))
            for value, kind in arguments
        )
        explained = psycopg_sql.SQL(explain + " EXECUTE guarded({})").format(literals)
        cursor.execute(explained)
        plan = "\n".join(row[0] for row in cursor.fetchall())
        cursor.execute("DEALLOCATE guarded")
        cursor.execute("RESET ALL")
    finally:
        cursor.close()
    return plan


HISTORY = 20_000  # finished rows, so that a scan would cost what it does in production


def with_history(db_url: str, pending_every: int = 1000, history: int = HISTORY) -> sa.Engine:
    """An engine on the test database, holding `history` tasks and messages, analyzed:
    every `pending_every`-th of them pending, the others finished (done, sent)."""
    engine = sa.create_engine(sa.make_url(db_url).set(drivername="postgresql+psycopg"))
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO outbox_tasks (task_id, tenant_id, payload, priority, deadline, hops, "
                "state, attempts, max_attempts, available_at, fence, created_at, updated_at) "
                "SELECT 't-' || n, 'a', '{}', 0, 1e12, 0, CASE WHEN n % :every = 0 THEN "
                "'pending' ELSE 'done' END, 1, 3, 0, 1, n, n FROM generate_series(1, :n) n"
            ),
            {"n": history, "every": pending_every},
        )
        conn.execute(
            sa.text(
                "INSERT INTO outbox_messages (reply_id, destination, body, content_hash, "
                "headers, state, attempts, fence, available_at, created_at) "
                "SELECT 'm-' || n, 'default', '\\x7b7d', 'h', '{}', CASE WHEN n % :every = 0 "
                "THEN 'pending' ELSE 'sent' END, 1, 1, 0, n FROM generate_series(1, :n) n"
            ),
            {"n": history, "every": pending_every},
        )
    with engine.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT").exec_driver_sql(
            "ANALYZE outbox_tasks, outbox_messages"
        )
    return engine


def claim_values(limit: int, destinations: list[str], **more: Any) -> dict[str, Any]:
    """The relay claim's parameters, for relay `r` on the database's clock."""
    return {
        "now": None,
        "claim_owner": "r",
        "lease": 30.0,
        "limit": limit,
        "unkeyed_limit": limit,
        "budget": 3,
        "destinations": destinations,
        **more,
    }


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_the_relay_claim_walks_only_its_own_destinations(db_url: str) -> None:
    # A tenth of the messages pending, over five destinations, a third of them keyed.
    engine = with_history(db_url, pending_every=10)
    with engine.begin() as conn:
        conn.exec_driver_sql(
            # Pending ids are the multiples of ten: spread by id / 10, not by id.
            "UPDATE outbox_messages SET destination = 'd' || mod(id / 10, 5), "
            "ordering_key = CASE WHEN mod(id / 10, 3) = 0 THEN 'k' || mod(id / 10, 7) END "
            "WHERE state = 'pending' AND mod(id / 10, 5) <> 0"
        )
    with engine.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT").exec_driver_sql(
            "ANALYZE outbox_messages"
        )
    try:
        with engine.connect() as conn:
            update = claims.claim_statement(PG)
            # Only the relay's destinations, and of those not the ones whose pipeline is
            # full: each picked along the destination-first index.
            plans = [
                generic_plan(
                    conn,
                    update,
                    claim_values(100, ["default", "hung"], skip_destinations=skipped),
                    session=CLAIMS,
                )
                for skipped in ([], ["hung"])
            ]
    finally:
        engine.dispose()
    for plan in plans:
        assert "ix_outbox_messages_unkeyed" in plan, plan
        assert "ix_outbox_messages_deliverable" not in plan, plan
        assert "Seq Scan on outbox_messages" not in plan, plan


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_the_relay_claim_walks_keys_one_probe_each_and_unkeyed_messages_apart(
    db_url: str,
) -> None:
    # Every pending message keyed, over 50 keys: the claim reaches each key by one probe
    # of the ordering index (a loose index scan), and walks unkeyed messages along an
    # index that holds none of them, never the pending messages held behind their key.
    engine = with_history(db_url, pending_every=1)
    with engine.begin() as conn:
        conn.exec_driver_sql("UPDATE outbox_messages SET ordering_key = 'k' || mod(id, 50)")
    with engine.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT").exec_driver_sql(
            "ANALYZE outbox_messages"
        )
    try:
        with engine.connect() as conn:
            claim = claims.claim_statement(PG)
            values = claim_values(
                100,
                ["default"],
                skip_destinations=[],
                key_cursors=["k20"],
                key_cap=200,
                key_heads=100,
            )
            plan = generic_plan(conn, claim, values, session=CLAIMS)
    finally:
        engine.dispose()
    assert "Recursive Union" in plan, plan
    assert "Seq Scan on outbox_messages" not in plan, plan
    assert "ix_outbox_messages_deliverable" not in plan, plan
    assert "ix_outbox_messages_unkeyed" in plan, plan
    lines = plan.splitlines()
    probes = [n for n, line in enumerate(lines) if "ix_outbox_messages_ordering" in line]
    assert probes, plan
    for n in probes:
        # Each probe starts after the previous key, and stops at its first entry.
        assert "ordering_key)::text >" in lines[n + 1], plan
        assert any("Limit" in line for line in lines[n - 3 : n]), plan


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
@pytest.mark.parametrize("unkeyed", [0, 100])
def test_a_later_round_of_a_claim_never_walks_the_unkeyed_index(db_url: str, unkeyed: int) -> None:
    # A claim's later rounds walk keys alone (outbox.drivers.postgresql.claims.KEY_ROUNDS):
    # behind a drained backlog that no vacuum has cleared yet, a walk of the unkeyed index
    # passes every entry it left, some tens of milliseconds a round.
    engine = with_history(db_url, pending_every=10)
    try:
        with engine.connect() as conn:
            values = claim_values(100, ["default"], skip_destinations=[], unkeyed_limit=unkeyed)
            values |= {"key_cursors": [None], "key_cap": 200, "key_heads": 100}
            plan = generic_plan(
                conn,
                claims.claim_statement(PG),
                values,
                session=CLAIMS,
                explain="EXPLAIN (ANALYZE)",
            )
    finally:
        engine.dispose()
    walks = [line for line in plan.splitlines() if "ix_outbox_messages_unkeyed" in line]
    assert walks, plan
    assert all(("never executed" in line) == (unkeyed == 0) for line in walks), plan


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
@pytest.mark.parametrize("mode", ["force_generic_plan", "force_custom_plan"])
def test_the_relay_claim_finds_its_picks_by_primary_key(db_url: str, mode: str) -> None:
    # A backlog of a few tens of thousands of pending rows made a hash join, building its
    # table by scanning every pending row, look cheaper than 500 primary-key probes.
    engine = with_history(db_url, pending_every=1)
    try:
        with engine.connect() as conn:
            update = claims.claim_statement(PG)
            values = claim_values(500, ["default"], skip_destinations=[])
            plan = generic_plan(conn, update, values, mode, session=CLAIMS)
    finally:
        engine.dispose()
    assert "Seq Scan on outbox_messages" not in plan, plan
    assert "pk_outbox_messages" in plan, plan


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
@pytest.mark.parametrize("capped", [False, True], ids=["uncapped", "tenant-capped"])
def test_the_task_claim_uses_the_claimable_index(db_url: str, capped: bool) -> None:
    engine = with_history(db_url)
    values = {"now": None, "claim_owner": "w", "lease": 30.0, "limit": 10, "tenant_cap": 2}
    try:
        with engine.connect() as conn:
            plan = generic_plan(
                conn, task_claims.claim_tasks_statement(PG, capped, manual_clock=False), values
            )
    finally:
        engine.dispose()
    assert "ix_outbox_tasks_claimable" in plan, plan


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
@pytest.mark.parametrize(
    ("statement", "index"),
    [
        (
            lambda name: task_reconcile.expire_past_deadline_statement(DRIVERS[name]),
            "ix_outbox_tasks_deadline",
        ),
        (
            lambda name: task_reconcile.reap_expired_task_leases_statement(DRIVERS[name]),
            "ix_outbox_tasks_running_tenant",
        ),
        # The reap PostgreSQL runs: the portable one, its reaped attempts recorded.
        (lambda name: reap_recording_statement(DRIVERS[name]), "ix_outbox_messages_lease"),
        # The relay's adoption of its own rows after a claim in doubt, on the claims' lane.
        (lambda name: leases.adopt_statement(DRIVERS[name]), "ix_outbox_messages_lease"),
    ],
    ids=["expire", "reap-tasks", "reap-messages", "adopt"],
)
def test_the_reconcile_steps_of_a_claim_walk_partial_indexes(
    db_url: str, statement: Any, index: str
) -> None:
    engine = with_history(db_url)
    try:
        with engine.connect() as conn:
            plan = generic_plan(conn, statement("postgresql"), {"now": None, "limit": 100})
    finally:
        engine.dispose()
    # Every scan of the table is of a partial index (over unfinished rows), never the
    # primary key or the heap, which would read the whole history.
    scans = [line for line in plan.splitlines() if "Scan" in line and "CTE Scan" not in line]
    assert scans, plan
    assert any(index in line for line in scans), plan
    for line in scans:
        assert "Seq Scan" not in line, plan


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_the_relay_gauges_read_no_delivered_history(db_url: str) -> None:
    engine = with_history(db_url)
    try:
        with engine.connect() as conn:
            statement = figures.destination_figures(bound_now("postgresql"))
            plan = generic_plan(conn, statement, {"now": None})
    finally:
        engine.dispose()
    # Pending, sending and dead each walk their own partial index: none reads sent rows.
    scans = [line for line in plan.splitlines() if "Scan" in line]
    assert len(scans) >= 3, plan
    for line in scans:
        assert "Seq Scan" not in line, plan
    # Dead rows through either index that holds dead rows only (the console's chart added
    # ix_outbox_messages_died, on when they fell due; the planner may take either).
    assert "ix_outbox_messages_dead" in plan or "ix_outbox_messages_died" in plan, plan


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
@pytest.mark.parametrize("mode", ["force_generic_plan", "force_custom_plan"])
def test_the_relay_chain_claim_walks_each_key_and_probes_by_primary_key(
    db_url: str, mode: str
) -> None:
    # A key's next messages are read along the ordering index from its first message,
    # at most the key's share of them, and updated by primary-key probes: neither the
    # pending backlog nor the delivered history is scanned.
    engine = with_history(db_url, pending_every=1)
    with engine.begin() as conn:
        conn.exec_driver_sql(
            "UPDATE outbox_messages SET ordering_key = 'k' || mod(id, 50) WHERE mod(id, 3) = 0"
        )
    with engine.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT").exec_driver_sql(
            "ANALYZE outbox_messages"
        )
    try:
        with engine.connect() as conn:
            statement = claims.chain_statement(PG)
            values = claim_values(
                500,
                ["default"],
                head_ids=[3, 6, 9],
                head_destinations=["default"] * 3,
                head_keys=["k3", "k6", "k9"],
                share=150,
                room=450,
            )
            plan = generic_plan(conn, statement, values, mode, session=CLAIMS)
    finally:
        engine.dispose()
    assert "Seq Scan on outbox_messages" not in plan, plan
    assert "ix_outbox_messages_ordering" in plan, plan
    assert "pk_outbox_messages" in plan, plan


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
@pytest.mark.parametrize("mode", ["force_generic_plan", "force_custom_plan"])
@pytest.mark.parametrize("statement", ["claim", "chain"])
def test_claims_probe_by_primary_key_behind_a_backlog_the_statistics_never_saw(
    db_url: str, mode: str, statement: str
) -> None:
    # Statistics taken while nothing was pending make an index of pending messages look
    # nearly empty: a claim's update then walked it whole (a second per claim behind a
    # backlog of 20,000) instead of probing its picks by primary key.
    engine = with_history(db_url, pending_every=HISTORY + 1)
    with engine.begin() as conn:
        conn.exec_driver_sql(
            "INSERT INTO outbox_messages (reply_id, destination, ordering_key, body, "
            "content_hash, headers, state, attempts, fence, available_at, created_at) "
            "SELECT 'p-' || n, 'default', CASE WHEN mod(n, 2) = 0 THEN 'k' || mod(n, 100) END, "
            "'\\x7b7d', 'h', '{}', 'pending', 0, 0, 0, n FROM generate_series(1, 20000) n"
        )
    try:
        with engine.connect() as conn:
            if statement == "claim":
                claim = claims.claim_statement(PG)
                values = claim_values(1000, ["default"], skip_destinations=[])
                values |= {"key_cursors": [None], "key_cap": 2000, "key_heads": 1000}
            else:
                claim = claims.chain_statement(PG)
                values = claim_values(
                    1000,
                    ["default"],
                    head_ids=[2, 4],
                    head_destinations=["default"] * 2,
                    head_keys=["k2", "k4"],
                    share=500,
                    room=998,
                )
            plan = generic_plan(conn, claim, values, mode, session=CLAIMS)
    finally:
        engine.dispose()
    assert "ix_outbox_messages_routable" not in plan, plan
    assert "ix_outbox_messages_deliverable" not in plan, plan
    assert "Seq Scan on outbox_messages" not in plan, plan


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
@pytest.mark.parametrize("mode", ["force_generic_plan", "force_custom_plan"])
@pytest.mark.parametrize("capped", [False, True], ids=["uncapped", "tenant-capped"])
def test_the_task_claim_walks_the_claimable_index_behind_a_backlog_the_statistics_never_saw(
    db_url: str, mode: str, capped: bool
) -> None:
    # Statistics taken while no task was pending: the pick walked ix_outbox_tasks_deadline
    # and sorted, and the update was a semi-join walking that index whole (every
    # unfinished task) at each claim, instead of probing its picks by primary key.
    engine = with_history(db_url, pending_every=HISTORY + 1)
    with engine.begin() as conn:
        conn.exec_driver_sql(
            "INSERT INTO outbox_tasks (task_id, tenant_id, payload, priority, deadline, hops, "
            "state, attempts, max_attempts, available_at, fence, created_at, updated_at) "
            "SELECT 'p-' || n, 'a', '{}', 0, 1e12, 0, 'pending', 0, 3, 0, 0, n, n "
            "FROM generate_series(1, 20000) n"
        )
    values = {"now": None, "claim_owner": "w", "lease": 30.0, "limit": 100, "tenant_cap": 2}
    try:
        with engine.connect() as conn:
            claim = task_claims.claim_tasks_statement(PG, capped, manual_clock=False)
            plan = generic_plan(conn, claim, values, mode, session=TASK_CLAIMS)
    finally:
        engine.dispose()
    assert "ix_outbox_tasks_claimable" in plan, plan
    assert "pk_outbox_tasks" in plan, plan
    assert "ix_outbox_tasks_deadline" not in plan, plan
    assert "Seq Scan on outbox_tasks" not in plan, plan


BATCH_TYPES = {
    "task_ids": "varchar[]",
    "owners": "varchar[]",
    "fences": "bigint[]",
    "results": "text[]",
    "reply_ids": "varchar[]",
    "destinations": "varchar[]",
    "bodies": "bytea[]",
    "hashes": "varchar[]",
    "headers": "text[]",
    "lease": "float8",
    "now": "float8",
}
"""The types of the batches' parameters, as psycopg sends them."""


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
@pytest.mark.parametrize("mode", ["force_generic_plan", "force_custom_plan"])
@pytest.mark.parametrize("batch", ["results", "renewals"])
@pytest.mark.parametrize(
    ("history", "beside"), [(HISTORY, 3000), (300, HISTORY)], ids=["analyzed-large", "grown-since"]
)
def test_a_batch_probes_its_tasks_by_primary_key_beside_many_running(
    db_url: str, mode: str, batch: str, history: int, beside: int
) -> None:
    # Statistics taken while no task ran make the running tasks' index look empty: joined
    # on the batch, a plan walked it whole (every running task of every worker) at each
    # batch, or rescanned the batch once per task in the table. Taken while the table was
    # small (then `beside` running tasks arrive), they must not make a plan for today's
    # table scan it whole.
    engine = with_history(db_url, pending_every=history + 1, history=history)
    size = 200
    with engine.begin() as conn:
        conn.exec_driver_sql(
            "INSERT INTO outbox_tasks (task_id, tenant_id, payload, priority, deadline, hops, "
            "state, attempts, max_attempts, available_at, owner, lease_until, fence, "
            "created_at, updated_at) "
            "SELECT 'r-' || n, 'a', '{}', 0, 1e12, 0, 'running', 1, 3, 0, "
            "CASE WHEN n <= %(size)s THEN 'w' ELSE 'other' END, 1e12, 7, n, n "
            "FROM generate_series(1, %(beside)s + %(size)s) n",
            {"size": size, "beside": beside},
        )
    ids = [f"r-{n}" for n in range(1, size + 1)]
    values: dict[str, Any] = {"task_ids": ids, "owners": ["w"] * size, "fences": [7] * size}
    values["now"] = None
    if batch == "results":
        statement, written = task_results.COMPLETE_POSTGRESQL, "CTE Scan on done"
        values |= {
            "results": ['{"ok":true}'] * size,
            "reply_ids": [f"reply-{task_id}" for task_id in ids],
            "destinations": ["default"] * size,
            "bodies": [b"{}"] * size,
            "hashes": ["h"] * size,
            "headers": None,
        }
    else:
        statement, written = task_renewals.RENEW_POSTGRESQL, "Update on outbox_tasks t"
        values["lease"] = 30.0
    order: list[str] = []

    def number(match: re.Match[str]) -> str:
        if match[1] not in order:
            order.append(match[1])
        return f"${order.index(match[1]) + 1}"

    sql = re.sub(r"%\((\w+)\)[sb]", number, statement)
    arguments = [(values[name], BATCH_TYPES[name]) for name in order]
    try:
        with engine.connect() as conn:  # rolled back: EXPLAIN ANALYZE runs the statement
            plan = prepared_plan(conn, sql, arguments, mode, explain="EXPLAIN (ANALYZE)")
    finally:
        engine.dispose()
    assert "ix_outbox_tasks_running_tenant" not in plan, plan
    assert "Seq Scan on outbox_tasks" not in plan, plan
    assert "Join Filter" not in plan, plan
    probe = rf"(Index Scan using|Bitmap Index Scan on) pk_outbox_tasks .*loops={size}\)"
    assert re.search(probe, plan), plan
    assert re.search(rf"Tid Scan on outbox_tasks .*rows=1 loops={size}\)", plan), plan
    assert re.search(rf"{written} .*rows={size} loops=1\)", plan), plan
