"""A PostgreSQL cluster owned by one test: initdb, start, crash-restart, stop.

Restarting the shared server would break everyone else's tests, so a test that
needs a real server crash makes its own cluster from the local binaries
(/usr/lib/postgresql/*/bin, or OUTBOXDEV_TEST_PG_BIN). initdb refuses to run as
root, so when we are root every command runs as the `postgres` user and the
cluster's folder belongs to it; it lives under the system temp dir because
pytest's tmp_path is private to root.

`restart()` is `pg_ctl restart -m immediate`: the postmaster and every backend
get SIGQUIT and die without a checkpoint, and the next start runs crash
recovery from the WAL, as after a crash of the server. fsync=off
only skips flushing to the disk: the OS still has every write, so nothing that
was committed before the crash is lost (synchronous_commit stays on for that
reason: with it off, a committed transaction could vanish in the crash).
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import psycopg
from support.receiver_helpers import free_port

from faults.owned_server import START_TIMEOUT, OwnedServer

BIN_VAR = "OUTBOXDEV_TEST_PG_BIN"
SUPERUSER = "postgres"
# fsync=off is safe across a killed server process (see the module docstring); the rest
# keeps a throwaway cluster small.
SETTINGS = ("fsync=off", "shared_buffers=32MB", "max_connections=100", "max_wal_size=256MB")


def find_bin() -> Path | None:
    """The folder holding initdb and pg_ctl (newest version first), or None."""
    candidates = [os.environ[BIN_VAR]] if os.environ.get(BIN_VAR) else []
    candidates += sorted(
        glob.glob("/usr/lib/postgresql/*/bin"),
        key=lambda p: int(Path(p).parent.name) if Path(p).parent.name.isdigit() else 0,
        reverse=True,
    )
    for folder in candidates:
        if all(os.access(Path(folder) / tool, os.X_OK) for tool in ("initdb", "pg_ctl")):
            return Path(folder)
    return None


class PgCluster(OwnedServer):
    """A throwaway cluster on a free loopback port, trust auth; a context manager."""

    name = "the test cluster"

    def __init__(self, bin_dir: Path) -> None:
        """Run initdb into a new temp folder; nothing listens until `start()`."""
        self.bin_dir = bin_dir
        self.port = free_port()
        self.root = Path(tempfile.mkdtemp(prefix="outbox-pgcluster-"))
        self.data = self.root / "data"
        self.sockets = self.root / "sockets"
        self.log = self.root / "server.log"
        self.sockets.mkdir()
        self._as_postgres = os.geteuid() == 0
        if self._as_postgres:
            try:
                account = pwd.getpwnam(SUPERUSER)
            except KeyError:
                shutil.rmtree(self.root, ignore_errors=True)
                raise RuntimeError(
                    f"running as root: initdb refuses root, and there is no {SUPERUSER!r} "
                    "user to run the test cluster as"
                ) from None
            for path in (self.root, self.sockets):
                os.chown(path, account.pw_uid, account.pw_gid)
        self.running = False
        try:
            self._run(
                "initdb",
                "-D",
                str(self.data),
                "-U",
                SUPERUSER,
                "--auth=trust",
                "--encoding=UTF8",
                "--locale=C",
                "--no-sync",
                "--no-instructions",
            )
        except BaseException:
            shutil.rmtree(self.root, ignore_errors=True)
            raise

    def url(self, database: str = "postgres") -> str:
        """A SQLAlchemy URL for `database` on this cluster (psycopg 3, TCP)."""
        return f"postgresql+psycopg://{SUPERUSER}@127.0.0.1:{self.port}/{database}"

    def start(self) -> None:
        """Start the server and wait until it accepts connections."""
        options = f"-p {self.port} -k {self.sockets} -c listen_addresses=127.0.0.1 " + " ".join(
            f"-c {setting}" for setting in SETTINGS
        )
        self._pg_ctl("start", "-o", options)
        self.running = True
        self.wait_accepting()

    def restart(self) -> float:
        """Crash the server (immediate mode, no checkpoint) and start it again; returns when.

        The returned time.monotonic() is the moment of the crash: faults are timed
        from there, not from when the server is back.
        """
        crashed = time.monotonic()
        # restart reuses the options of the last start (postmaster.opts).
        self._pg_ctl("restart", "-m", "immediate")
        self.wait_accepting()
        return crashed

    def halt(self) -> None:
        """Stop the server at once (immediate: nothing in it is worth a checkpoint)."""
        if self.running:
            self._pg_ctl("stop", "-m", "immediate")
            self.running = False

    def create_database(self, name: str) -> str:
        """Create database `name`; returns its URL."""
        with psycopg.connect(self._conninfo("postgres"), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def accepting(self) -> bool:
        """Whether a new session can run a query now (not down, not in recovery)."""
        try:
            with psycopg.connect(self._conninfo("postgres"), connect_timeout=2) as conn:
                conn.execute("SELECT 1")
        except psycopg.OperationalError:
            return False
        return True

    def _conninfo(self, database: str) -> str:
        return f"host=127.0.0.1 port={self.port} user={SUPERUSER} dbname={database}"

    def _pg_ctl(self, *args: str) -> None:
        # Always -l: a server started without it writes to pg_ctl's output, our pipe, which
        # would then never reach EOF.
        self._run(
            "pg_ctl",
            "-D",
            str(self.data),
            "-l",
            str(self.log),
            "-w",
            "-t",
            str(int(START_TIMEOUT)),
            *args,
        )

    def _run(self, tool: str, *args: str) -> None:
        command = [str(self.bin_dir / tool), *args]
        if self._as_postgres:
            command = ["runuser", "-u", SUPERUSER, "--", *command]
        done = subprocess.run(
            command,
            cwd=self.root,
            capture_output=True,
            text=True,
            timeout=START_TIMEOUT + 30,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(
                f"{tool} {' '.join(args)} exited with {done.returncode}:\n"
                f"{done.stdout}\n{done.stderr}\n{self.log_tail()}"
            )
