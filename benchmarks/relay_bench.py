"""Relay benchmarks on the local PostgreSQL: backlog drain, live latency, single mode.

Run: .venv/bin/python -m benchmarks.relay_bench [--messages 200000] [--quick]

Each scenario gets a fresh database, a real receiver process (uvicorn) and
real relay processes (`outbox relay`), so the figures include HTTP, signing,
the receiver's commit of receipts and effects, and the relay's settle.
"""

from __future__ import annotations

import argparse
import base64
import json
import multiprocessing
import os
import select
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import sqlalchemy as sa
from sqlalchemy.orm import Session

import outbox
from benchmarks import launcher as launch
from benchmarks.cpu import (
    PartSeconds,
    cpu_between,
    machine_busy_seconds,
    part_cpu_seconds,
    parts_between,
    process_cpu_seconds,
)
from benchmarks.databases import analyze, migrated_database
from outbox.canonical import canonical_bytes, sha256_hex
from outbox.messages import check_headers
from outbox.receiver_tables import receipts
from outbox.schema import messages
from outbox.trace_context import TRACEPARENT
from relay.config import Destination

ADMIN_URL = os.environ.get("OUTBOXDEV_BENCH_PG_URL", "postgresql+psycopg://postgres@127.0.0.1/test")
ROOT = Path(__file__).resolve().parent.parent
# Requests in flight per destination: the relay's default unless overridden.
CONCURRENCY = int(os.environ.get("OUTBOXDEV_BENCH_CONCURRENCY", Destination.concurrency))
WARMUP_SECONDS = 1.0
READY_SECONDS = 60.0
"""How long a process started for a run has to say it is up (a busy machine starts slowly)."""
DRAIN_DEADLINE_SECONDS = 1200.0
# The reference receiver takes up to 1000 replies per POST: one POST per turn.
BATCH_ITEMS = int(os.environ.get("OUTBOXDEV_BENCH_BATCH_ITEMS", "1000"))
SECRET = "whsec_" + base64.b64encode(b"benchmark-secret-0123456789abcdef").decode()


def log(text: str) -> None:
    """Progress on stderr, so stdout stays the result."""
    print(text, file=sys.stderr, flush=True)


def fresh_database() -> AbstractContextManager[str]:
    """A new, migrated PostgreSQL database, dropped afterwards."""
    return migrated_database(
        ADMIN_URL, 'CREATE DATABASE "{name}"', 'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'
    )


def free_port() -> int:
    """A free loopback port."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def pending_row(
    reply_id: str,
    body: bytes,
    available_at: float = 0.0,
    ordering_key: str | None = None,
    destination: str = "default",
    headers: str = "{}",
) -> dict[str, Any]:
    """An outbox_messages row as publish() would write it, for writes that bypass it (an
    INSERT or prefill's COPY); `headers` is the headers column (canonical JSON,
    outbox.messages.check_headers)."""
    return {
        "reply_id": reply_id,
        "destination": destination,
        "ordering_key": ordering_key,
        "body": body,
        "content_hash": sha256_hex(body),
        "headers": headers,
        "state": "pending",
        "attempts": 0,
        "fence": 0,
        "available_at": available_at,
        "created_at": time.time(),
    }


def prefill(url: str, count: int, *, creation_contexts: bool = False) -> None:
    """Write `count` pending messages in one transaction (setup, not measured): one COPY
    on PostgreSQL, INSERTs of 20,000 rows elsewhere (COPY is PostgreSQL's alone).

    With `creation_contexts`, each carries a traceparent of its own, as messages published
    inside their requests' spans do (outbox.trace_context).
    """
    engine = outbox.create_engine(url)
    rows = [
        pending_row(
            f"bench-{n}",
            canonical_bytes({"kind": "result", "n": n, "payload": "x" * 64}),
            headers=creation_headers(n) if creation_contexts else "{}",
        )
        for n in range(count)
    ]
    with engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            copy_rows(conn, rows)
        else:
            for start in range(0, count, 20_000):
                conn.execute(sa.insert(messages), rows[start : start + 20_000])
    analyze(engine, "outbox_messages")
    engine.dispose()


def copy_rows(conn: sa.Connection, rows: list[dict[str, Any]]) -> None:
    """Write `rows` (pending_row's) into outbox_messages with one COPY, in the connection's
    transaction: the same rows as the INSERTs in a quarter of the time, and a full suite
    prefills over a hundred backlogs of 200,000.

    COPY writes the table through a small ring of PostgreSQL's buffers, so a prefilled
    table starts mostly in the OS cache rather than in shared buffers, for ours and every
    baseline alike.
    """
    if not rows:
        return
    columns = list(rows[0])
    driver = conn.connection.driver_connection
    assert driver is not None, "a connection checked out of the pool has its driver's"
    with (
        driver.cursor() as cursor,
        cursor.copy(f"COPY outbox_messages ({', '.join(columns)}) FROM STDIN") as copy,
    ):
        for row in rows:
            copy.write_row([row[column] for column in columns])


def creation_headers(n: int) -> str:
    """The headers column of message `n` published inside a sampled span of a trace of its
    own: its creation context, as publish() stores it."""
    traceparent = f"00-{n + 1:032x}-{n + 1:016x}-01"
    return check_headers(None, {TRACEPARENT: traceparent})


@contextmanager
def receiver_process(url: str, workdir: Path, *, reference_effect: bool = True) -> Iterator[str]:
    """The reference receiver in its own process; yields its /replies URL.

    Without `reference_effect` it stores receipts and nothing else, as the bare receiver
    does (benchmarks.receipts_receiver): what the comparisons with the bare relay use.
    Started by the launcher in effect (benchmarks.launcher).
    """
    secret_file = workdir / "secret"
    secret_file.write_text(SECRET + "\n")
    port = free_port()
    launcher = launch.current()
    proc = subprocess.Popen(
        launcher.command(
            "-m",
            "outbox_cli" if reference_effect else "benchmarks.receipts_receiver",
            "receiver",
            "--db",
            url,
            "--port",
            str(port),
            "--secret-file",
            str(secret_file),
        ),
        cwd=ROOT,
        env=launcher.environment(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    base = f"http://127.0.0.1:{port}"
    wait_healthy(base + "/healthz")
    try:
        yield base + "/replies"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)  # reaps it and closes its pipe


TomlValue = str | int | float | bool
Settings = Mapping[str, TomlValue]

KEYED_SETTINGS: dict[str, TomlValue] = {"ordered_batches": True}
"""Destination settings of every keyed run, over http_destination's: the keyed drains'
batch destination (their unkeyed baselines drain through it too) and the keyed live run.
A setting made for ordering keys is one line here."""


def toml_value(value: TomlValue) -> str:
    """`value` as TOML: a bool as true/false, a string quoted, a number as it is."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string of these characters is a TOML basic string
    return repr(value)


def http_destination(target: str, secret_file: Path, mode: str) -> dict[str, TomlValue]:
    """The settings every benchmark destination has: the HTTP ones, sending to `target`."""
    return {
        "url": target,
        "secret_file": str(secret_file),
        "mode": mode,
        "timeout": 10,
        "concurrency": CONCURRENCY,
        "max_batch_items": BATCH_ITEMS,
    }


def relay_config(path: Path, batch: int, destinations: Mapping[str, Settings]) -> Path:
    """Write a relay config with the benchmarks' [relay] settings and `destinations`."""
    text = f"[relay]\nbatch = {batch}\nlease = 30\npoll_interval = 0.05\nmax_attempts = 5\n"
    for name, settings in destinations.items():
        text += f"[destinations.{name}]\n"
        text += "".join(f"{key} = {toml_value(value)}\n" for key, value in settings.items())
    path.write_text(text)
    return path


@contextmanager
def relay_processes(
    url: str,
    target: str,
    workdir: Path,
    count: int,
    mode: str,
    batch: int,
    broker: dict[str, str] | None = None,
    settings: Settings | None = None,
) -> Iterator[None]:
    """`count` relay processes delivering to `target` over HTTP in `mode`.

    With `broker` (the destination's kind and its own keys: stream and subject, or
    exchange and routing_key), to that broker at `target` instead; every other
    setting is the same. `settings` are added to the destination's (KEYED_SETTINGS).
    """
    secret_file = workdir / "secret"
    secret_file.write_text(SECRET + "\n")
    destination = http_destination(target, secret_file, mode)
    if broker is not None:
        del destination["mode"]
        destination |= broker
    config = relay_config(
        workdir / f"relay-{mode if broker is None else broker['kind']}.toml",
        batch,
        {"default": destination | dict(settings or {})},
    )
    with started_relays(url, config, count):
        yield


@contextmanager
def started_relays(url: str, config: Path, count: int) -> Iterator[None]:
    """`count` `outbox relay` processes reading `config`, from when each answers its readiness
    check; SIGTERMed and reaped after. Started by the launcher in effect (benchmarks.launcher)."""
    ports = [free_port() for _ in range(count)]
    launcher = launch.current()
    procs = [
        subprocess.Popen(
            launcher.command(
                "-m",
                "outbox_cli",
                "relay",
                "--db",
                url,
                "--config",
                str(config),
                "--owner",
                f"bench-relay-{n}",
                "--log-level",
                "WARNING",
                "--metrics-port",
                str(port),
            ),
            cwd=ROOT,
            env=launcher.environment(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        for n, port in enumerate(ports)
    ]
    try:
        # Measured from when every relay delivers (/readyz), not from when its interpreter
        # starts, as the bare relays are from their `ready` line.
        for port in ports:
            wait_healthy(f"http://127.0.0.1:{port}/readyz")
        yield
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            proc.communicate(timeout=60)  # reaps it and closes its pipe


@contextmanager
def ready_processes(*commands: tuple[str, ...]) -> Iterator[None]:
    """`python -m <command>` for each command, from every one's `ready` line on; each
    SIGTERMed and reaped after.

    Like our relays' readiness checks, the `ready` lines put the interpreters' start-up
    outside the timed window. All start before any is waited for, as our relays do. A
    process that ended before it was stopped is an error.
    """
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for command in commands:
            # Our interpreter running our modules, with arguments built here.
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", *command],
                    cwd=ROOT,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                )
            )
        deadline = time.monotonic() + READY_SECONDS
        for proc in procs:
            out = proc.stdout
            assert out is not None, "started with stdout piped"
            readable, _, _ = select.select([out], [], [], max(0.0, deadline - time.monotonic()))
            if not readable or out.readline() != b"ready\n":
                raise RuntimeError(f"{proc.args!r} did not start")
        yield
        for proc in procs:
            if proc.poll() is not None:
                _, err = proc.communicate()
                raise RuntimeError(f"{proc.args!r} ended early: {err.decode()[-2000:]}")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            proc.communicate(timeout=30)


def children_running(word: str) -> list[int]:
    """Pids of this process's children running `outbox_cli <word>` (relay, receiver)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue  # ended meanwhile
        # The command name in parentheses may hold spaces: the parent pid follows it.
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        if parent == os.getpid() and b"outbox_cli" in argv and word.encode() in argv:
            pids.append(int(entry.name))
    return pids


def run_alone(prog: str, run: Callable[[bool], dict[str, float]], argv: Any = None) -> int:
    """The main() of a scenario module run by itself: one run, its figures as JSON."""
    parser = argparse.ArgumentParser(prog=prog)
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    args = parser.parse_args(None if argv is None else list(argv))
    print(json.dumps(run(args.quick)))
    return 0


def wait_healthy(url: str, seconds: float = READY_SECONDS) -> None:
    """Poll a health endpoint until it answers 200."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        threading.Event().wait(0.05)
    raise RuntimeError(f"{url} did not become healthy")


def count_sent(engine: sa.Engine) -> int:
    """Messages in state sent (a full scan: for the end of a run, not for polling)."""
    with engine.connect() as conn:
        return int(
            conn.execute(
                sa.select(sa.func.count()).select_from(messages).where(messages.c.state == "sent")
            ).scalar_one()
        )


def undelivered(engine: sa.Engine) -> bool:
    """Whether any message is still pending or sending (cheap: the partial indexes answer)."""
    # Each query is ordered like its state's partial index, so the index answers it
    # instead of a scan through the rows already sent.
    queries = [
        sa.select(messages.c.id)
        .where(messages.c.state == "pending")
        .order_by(messages.c.available_at, messages.c.id),
        sa.select(messages.c.id)
        .where(messages.c.state == "sending")
        .order_by(messages.c.lease_until),
    ]
    with engine.connect() as conn:
        return any(conn.execute(query.limit(1)).first() is not None for query in queries)


def drain(
    total: int, mode: str, relays: int, batch: int, *, reference_effect: bool = True
) -> dict[str, Any]:
    """Time for `relays` relay processes to deliver a pre-filled backlog of `total`."""
    with fresh_database() as url:
        log(f"  prefill {total} messages")
        prefill(url, total)
        return drain_backlog(url, total, mode, relays, batch, reference_effect=reference_effect)


def sent_since(engine: sa.Engine, first_id: int) -> int:
    """Messages sent among those with id >= first_id (a key range: history is not scanned)."""
    with engine.connect() as conn:
        query = sa.select(sa.func.count()).where(
            messages.c.id >= first_id, messages.c.state == "sent"
        )
        return int(conn.execute(query).scalar_one())


def drain_backlog(
    url: str,
    total: int,
    mode: str,
    relays: int,
    batch: int,
    first_id: int = 1,
    receiver_url: str | None = None,
    *,
    reference_effect: bool = True,
) -> dict[str, Any]:
    """Deliver the `total` pending messages from id `first_id` on, already in `url`; timed.

    The database may hold history (rows before `first_id`); it is never counted.
    The receiver stores its receipts in `receiver_url`, by default the same database.
    """
    with (
        tempfile.TemporaryDirectory() as tmp,
        receiver_process(
            receiver_url or url, Path(tmp), reference_effect=reference_effect
        ) as target,
    ):
        result = timed_drain(
            url,
            total,
            lambda: relay_processes(url, target, Path(tmp), relays, mode, batch),
            first_id,
            parts=drain_part,
        )
    return {"scenario": f"drain-{mode}", **result}


def timed_drain(
    url: str,
    total: int,
    start_relays: Callable[[], AbstractContextManager[object]],
    first_id: int = 1,
    server: str | None = None,
    window: float | None = None,
    parts: Callable[[str], str | None] | None = None,
) -> dict[str, Any]:
    """Time the relays `start_relays` starts until nothing from id `first_id` on is undelivered.

    Timed from when every relay is up (what they sent while the others started is
    subtracted) to when no message is pending or sending, or, with `window`, at most
    that many seconds (for a relay too slow to drain the backlog in a run's time).
    Over the same window, the machine's CPU per message sent and, with `server` (a
    process name: the broker), that process's CPU per message. With `parts` (see
    cpu.part_cpu_seconds), the CPU per message of each part and of its database backends,
    as figures `cpu_us_<part>`.
    """
    engine = outbox.create_engine(url)
    try:
        checkpoint(engine)
        launched = time.monotonic()
        at_launch = machine_busy_seconds(), server_seconds(server)
        parts_at_launch = parts_seconds(engine, parts)
        with start_relays():
            # Timed from when every relay is up; what they sent while the others
            # started is subtracted.
            started = time.monotonic()
            before = sent_since(engine, first_id)
            at_start = machine_busy_seconds(), server_seconds(server)
            parts_at_start = parts_seconds(engine, parts)
            deadline = started + DRAIN_DEADLINE_SECONDS
            pause = threading.Event()
            closes = None if window is None else started + window
            windowed = False
            while undelivered(engine):
                now = time.monotonic()
                if closes is not None and now >= closes:
                    windowed = True
                    break
                if now > deadline:
                    raise RuntimeError(f"relays did not drain {total} in time")
                pause.wait(0.05)
            finished = time.monotonic()
            # Counted before the relays stop, so the window holds all it is credited with.
            sent = sent_since(engine, first_id)
            at_end = machine_busy_seconds(), server_seconds(server)
            parts_at_end = parts_seconds(engine, parts)
    finally:
        engine.dispose()
    timed_from = "every relay up"
    if before > total // 2 and not windowed:
        # A small backlog on a busy machine: most of it went while the last relay was
        # still starting, so that window would time almost nothing. Time the whole run.
        started, before, timed_from = launched, 0, "first relay started"
        # The parts over the same whole run: a relay started since counts its whole life.
        at_start, parts_at_start = at_launch, parts_at_launch
    elapsed = finished - started
    busy = at_end[0] - at_start[0]
    served = cpu_between(at_start[1], at_end[1])
    moved = max(sent - before, 1)
    cpu = {"cpu_us_per_message": round(busy * 1e6 / moved, 1)}
    if server is not None:
        if not at_start[1].keys() & at_end[1].keys():
            # A broker restarted meanwhile: its CPU over the window cannot be read.
            raise RuntimeError(f"no {server!r} process ran through the whole drain")
        cpu["server_cpu_us_per_message"] = round(served * 1e6 / moved, 1)
    for part, spent in parts_between(parts_at_start, parts_at_end).items():
        cpu[f"cpu_us_{part}"] = round(spent * 1e6 / moved, 1)
    return {
        "messages": total,
        "seconds": round(elapsed, 2),
        "rate": round((sent - before) / elapsed),
        "timed_from": timed_from,
        "complete": sent == total,
        "windowed": windowed,
        **cpu,
    }


def checkpoint(engine: sa.Engine) -> None:
    """On PostgreSQL, a CHECKPOINT: every timed drain then starts at the same point of the
    server's checkpoint cycle.

    A run writes several gigabytes of WAL, so the server checkpoints every half minute or
    so (max_wal_size); after each checkpoint the first change of every page writes the
    whole page to the WAL. Left to chance, one drain starts just after a checkpoint and
    pays for every page it touches while the next pays for few, whichever side of a
    comparison each is.
    """
    if engine.dialect.name != "postgresql":
        return
    with engine.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT").exec_driver_sql("CHECKPOINT")


@dataclass(frozen=True)
class Backlog:
    """A backlog for keyed_drains: `messages` pending rows over `keys` ordering keys (0: none),
    for the destination of `mode` ("batch" or "single")."""

    name: str
    messages: int
    keys: int = 0
    mode: str = "batch"

    def rows(self) -> list[dict[str, Any]]:
        """Its rows; message n has key n % keys, so the keys interleave as live traffic's do."""
        return [
            pending_row(
                f"{self.name}-{n}",
                canonical_bytes({"kind": "result", "n": n, "payload": "x" * 64}),
                ordering_key=f"{self.name}-key-{n % self.keys}" if self.keys else None,
                destination=self.mode,
            )
            for n in range(self.messages)
        ]


def keyed_drains(
    backlogs: Sequence[Backlog], relays: int = 2, batch: int = 1000
) -> dict[str, dict[str, Any]]:
    """Each backlog in turn, drained by the same receiver and `relays` relays; by name.

    One database, one receiver and one set of relays for all: each backlog is
    committed in one transaction while the relays idle (the last one drained) and is
    timed from that commit to its last message sent (drain_committed). The relays have
    two destinations: `batch` (batch mode, with KEYED_SETTINGS) and `single`.
    """
    with fresh_database() as url, tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        with receiver_process(url, workdir) as target:
            secret_file = workdir / "secret"  # written by receiver_process
            config = relay_config(
                workdir / "relay-keyed.toml",
                batch,
                {
                    "batch": http_destination(target, secret_file, "batch") | KEYED_SETTINGS,
                    "single": http_destination(target, secret_file, "single"),
                },
            )
            engine = outbox.create_engine(url)
            try:
                with started_relays(url, config, relays):
                    results = {}
                    for backlog in backlogs:
                        results[backlog.name] = drain_committed(engine, backlog)
                        log(f"  {backlog.name}: {results[backlog.name]}")
                    return results
            finally:
                engine.dispose()


def drain_committed(engine: sa.Engine, backlog: Backlog) -> dict[str, Any]:
    """Commit `backlog` in one transaction and wait until it is delivered; its rate.

    Timed from the commit to the largest sent_at of its messages (the database's clock,
    which is the host's: a poll's interval is not counted), so a backlog that drains in
    a few milliseconds is timed as closely as a long one.
    """
    with engine.connect() as conn:
        last_id = conn.execute(sa.select(sa.func.max(messages.c.id))).scalar_one()
    first_id = (last_id or 0) + 1
    rows = backlog.rows()
    with engine.begin() as conn:
        for start in range(0, len(rows), 20_000):
            conn.execute(sa.insert(messages), rows[start : start + 20_000])
    committed = time.time()
    deadline = time.monotonic() + DRAIN_DEADLINE_SECONDS
    pause = threading.Event()
    while undelivered(engine):
        if time.monotonic() > deadline:
            raise RuntimeError(f"relays did not drain {backlog} in time")
        pause.wait(0.02)
    with engine.connect() as conn:
        sent, last_sent = conn.execute(
            sa.select(sa.func.count(), sa.func.max(messages.c.sent_at)).where(
                messages.c.id >= first_id, messages.c.state == "sent"
            )
        ).one()
    seconds = max(float(last_sent or committed) - committed, 1e-3)
    return {
        "messages": backlog.messages,
        "keys": backlog.keys,
        "mode": backlog.mode,
        "seconds": round(seconds, 3),
        "rate": round(sent / seconds),
        "complete": sent == backlog.messages,
    }


def drain_part(argv: str) -> str | None:
    """The part of a drain a process is, from its command line: relay, receiver or None."""
    words = argv.split()
    if "relay" in words or "benchmarks.bare_relay" in words:
        return "relay"
    if "receiver" in words or any(
        w.startswith("benchmarks.") and w.endswith("receiver") for w in words
    ):
        return "receiver"
    return None


def parts_seconds(engine: sa.Engine, parts: Callable[[str], str | None] | None) -> PartSeconds:
    """CPU seconds so far by part (cpu.part_cpu_seconds), none without `parts` or PostgreSQL."""
    if parts is None or engine.dialect.name != "postgresql":
        return {}
    with engine.connect() as conn:
        query = "SELECT pid, client_port FROM pg_stat_activity WHERE client_port IS NOT NULL"
        backends = [(int(pid), int(port)) for pid, port in conn.exec_driver_sql(query)]
    return part_cpu_seconds(parts, backends)


def server_seconds(server: str | None) -> dict[int, float]:
    """CPU seconds used so far by each process named `server`, by pid; none for None."""
    if server is None:
        return {}
    found = process_cpu_seconds(server)
    if not found:
        # Otherwise the server's share would read as 0 us per message, not as unmeasured.
        raise RuntimeError(f"no process named {server!r} is running on this machine")
    return found


def produce(
    url: str,
    index: int,
    ready: Any,
    go: Any,
    stop: Any,
    counts: Any,
    rate: float,
    keys: int = 0,
    producers: int = 1,
) -> None:
    """A producer process: one publish per transaction from `go` until told to stop.

    At its full rate when `rate` is 0, else paced to `rate` commits per second. Puts
    (index, [the wall-clock time each commit returned]) on `counts` at the end. With
    `keys`, each message carries an ordering key (see live_key).
    """
    engine = outbox.create_engine(url)
    with engine.connect():
        pass  # connected before the clock starts
    ready.release()
    go.wait()
    committed: list[float] = []
    started = time.monotonic()
    while not stop.is_set():
        with Session(engine) as session, session.begin():
            key = live_key(index, len(committed), keys, producers)
            outbox.publish(
                session, "default", f"live-{index}-{len(committed)}", {"n": 1}, ordering_key=key
            )
        committed.append(time.time())  # the host clock, which the database reads too
        if rate:
            stop.wait(max(0.0, started + len(committed) / rate - time.monotonic()))
    engine.dispose()
    counts.put((index, committed))


def live_key(index: int, n: int, keys: int, producers: int) -> str | None:
    """The ordering key of producer `index`'s `n`-th message: none without `keys`.

    The keys are shared out among the producers, as each entity's messages come from
    one service: producer i takes keys i, i + producers, ... in turn, so at the same
    pace a key's messages are `keys / producers` commits of its producer apart.
    """
    if not keys:
        return None
    return f"key-{(n * producers + index) % keys}"


def count_undelivered(engine: sa.Engine) -> int:
    """Messages still pending or sending."""
    with engine.connect() as conn:
        query = sa.select(sa.func.count()).where(messages.c.state.in_(("pending", "sending")))
        return int(conn.execute(query).scalar_one())


Deliverers = Callable[[str, Path], AbstractContextManager[None]]
"""Starts what delivers the messages of the database at a URL (a receiver and relays), given
a work directory; they run while the context is open."""


def our_relays(
    relays: int, settings: Settings | None = None, *, reference_effect: bool = True
) -> Deliverers:
    """The reference receiver and `relays` relays in batch mode, as the live runs use them;
    `settings` added to the destination's."""

    @contextmanager
    def start(url: str, workdir: Path) -> Iterator[None]:
        with (
            receiver_process(url, workdir, reference_effect=reference_effect) as target,
            relay_processes(url, target, workdir, relays, "batch", 500, settings=settings),
        ):
            yield

    return start


def live(
    duration: float,
    producers: int,
    relays: int,
    rate: float = 0,
    keys: int = 0,
    *,
    reference_effect: bool = True,
) -> dict[str, Any]:
    """Producers commit one row per transaction while `relays` relays run: commit-to-receipt.

    With `keys`, the messages carry that many ordering keys (live_key) and the
    destination has KEYED_SETTINGS.
    """
    deliver = our_relays(
        relays, KEYED_SETTINGS if keys else None, reference_effect=reference_effect
    )
    return {
        "scenario": f"live-{producers}-producers"
        + (f"-paced-{rate:g}" if rate else "")
        + (f"-{keys}-keys" if keys else "")
        + f"-{relays}-relay{'s' if relays > 1 else ''}",
        **live_through(duration, producers, rate, deliver, receipts, keys),
    }


def live_through(
    duration: float,
    producers: int,
    rate: float,
    deliver: Deliverers,
    receipts_table: sa.Table,
    keys: int = 0,
) -> dict[str, Any]:
    """Producers commit one row per transaction while `deliver`'s relays run: commit-to-receipt.

    Receipt times are read from `receipts_table` (reply_id, received_at), where the
    receiver `deliver` starts records them. With `keys`, the messages carry ordering keys
    (live_key).
    """
    with fresh_database() as url, tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        engine = outbox.create_engine(url)
        # One process per producer, as services would be: threads of one interpreter
        # would measure its lock, not the outbox.
        spawn = multiprocessing.get_context("spawn")
        ready, go, stop = spawn.Semaphore(0), spawn.Event(), spawn.Event()
        counts = spawn.Queue()
        with deliver(url, workdir):
            procs = [
                spawn.Process(
                    target=produce,
                    args=(url, index, ready, go, stop, counts, rate, keys, producers),
                )
                for index in range(producers)
            ]
            for proc in procs:
                proc.start()
            # Interpreters that are still starting would compete with the first deliveries.
            for _ in procs:
                if not ready.acquire(timeout=60):
                    raise RuntimeError("a producer did not start")
            go.set()
            stop.wait(duration)
            stop.set()
            commits = dict(counts.get(timeout=60) for _ in procs)
            total = sum(len(times) for times in commits.values())
            for proc in procs:
                proc.join(timeout=60)
            # The backlog when producers stop: flat means the relays kept up.
            backlog_at_stop = count_undelivered(engine)
            deadline = time.monotonic() + 60
            while undelivered(engine) and time.monotonic() < deadline:
                threading.Event().wait(0.1)
        with engine.connect() as conn:
            rows = conn.execute(
                sa.select(
                    receipts_table.c.reply_id, receipts_table.c.received_at, messages.c.created_at
                )
                .join(messages, messages.c.reply_id == receipts_table.c.reply_id)
                .order_by(messages.c.created_at)
            ).all()
        engine.dispose()
    # The first second warms caches (statement compilation, prepared plans) in every
    # process; it is counted in `messages` but left out of the quantiles.
    first = rows[0].created_at
    from_commit, from_insert = [], []
    for row in rows:
        if row.created_at < first + WARMUP_SECONDS:
            continue
        _, index, n = row.reply_id.split("-")
        from_commit.append(row.received_at - commits[int(index)][int(n)])
        from_insert.append(row.received_at - row.created_at)
    return {
        "messages": total,
        "rate": round(total / duration),
        "backlog_at_stop": backlog_at_stop,
        "warmup_s": WARMUP_SECONDS,
        **_quantiles_ms("", from_commit),
        **_quantiles_ms("from_insert_", from_insert),
    }


def _quantiles_ms(prefix: str, seconds: list[float]) -> dict[str, float]:
    """p50 and p99 in milliseconds."""
    quantile = statistics.quantiles(seconds, n=100)
    return {
        f"{prefix}p50_ms": round(quantile[49] * 1000, 1),
        f"{prefix}p99_ms": round(quantile[98] * 1000, 1),
    }


def main() -> int:
    """Run the scenarios and print one JSON line each."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--messages", type=int, default=200_000)
    parser.add_argument("--single-messages", type=int, default=10_000)
    parser.add_argument("--live-seconds", type=float, default=10.0)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--relays", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1000)
    parser.add_argument(
        "--live-relays",
        type=lambda text: [int(n) for n in text.split(",")],
        default=[1, 2],
        help="relay counts for the full-rate live runs, comma-separated (the first is also "
        "used paced)",
    )
    parser.add_argument(
        "--live-paced", type=float, default=250, help="commits/s per producer; 0 skips the run"
    )
    parser.add_argument("--only", choices=("drain", "single", "live"))
    args = parser.parse_args()
    if args.quick:
        args.messages, args.single_messages, args.live_seconds = 5_000, 1_000, 3.0
    results = []
    if args.only in (None, "drain"):
        log("drain (batch mode, 2 relays)")
        results.append(drain(args.messages, "batch", args.relays, args.batch))
    if args.only in (None, "single"):
        log("drain (single mode, 1 relay)")
        results.append(drain(args.single_messages, "single", 1, 500))
    if args.only in (None, "live"):
        for relays in args.live_relays:
            log(f"live latency (4 producers, {relays} relay(s))")
            results.append(live(args.live_seconds, 4, relays))
        if args.live_paced:
            relays = args.live_relays[0]
            log(f"live latency (4 producers at {args.live_paced:g}/s each, {relays} relay(s))")
            results.append(live(args.live_seconds, 4, relays, args.live_paced))
    for result in results:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
