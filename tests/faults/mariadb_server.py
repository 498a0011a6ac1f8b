"""A MariaDB server owned by one test: install, start, crash-restart, stop.

Killing the shared server would break everyone else's tests, so a test that needs a
real server crash makes its own from the local binaries (mariadb-install-db and
mariadbd, or OUTBOXDEV_TEST_MARIADB_BIN). It runs as the current user (`--user` names
it, which mariadbd requires of root) in a temp folder of its own.

`restart()` sends SIGKILL to mariadbd and starts it again on the same folder: InnoDB's
crash recovery replays its redo log, as after a crash of the server.
innodb_flush_log_at_trx_commit=2 writes the log to the OS at every commit and flushes
it to disk once a second: a killed process loses nothing the OS holds, so nothing
committed before the crash is lost (only a crash of the machine would lose the last
second). No binary log: the toolkit refuses a statement-based one, and a throwaway
server needs none.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pymysql
from support.receiver_helpers import free_port

from faults.owned_server import START_TIMEOUT, OwnedServer

BIN_VAR = "OUTBOXDEV_TEST_MARIADB_BIN"
SETTINGS = (
    "--skip-log-bin",
    "--innodb-flush-log-at-trx-commit=2",
    "--innodb-buffer-pool-size=64M",
    "--skip-name-resolve",
    "--max-connections=200",
)
"""The flush setting is safe across a killed server process (see the module docstring);
the rest keeps a throwaway server small."""


def find_bin() -> tuple[Path, Path] | None:
    """mariadb-install-db and mariadbd, or None when either is missing."""
    folders = [os.environ[BIN_VAR]] if os.environ.get(BIN_VAR) else ["/usr/bin", "/usr/sbin"]
    found = {}
    for tool in ("mariadb-install-db", "mariadbd"):
        for folder in folders:
            if os.access(Path(folder) / tool, os.X_OK):
                found[tool] = Path(folder) / tool
                break
    if len(found) < 2:
        return None
    return found["mariadb-install-db"], found["mariadbd"]


class MariaDBServer(OwnedServer):
    """A throwaway server on a free loopback port, root without a password; a context
    manager."""

    name = "the test's MariaDB"

    def __init__(self, install_db: Path, mariadbd: Path) -> None:
        """Install the system tables into a new temp folder; nothing listens until
        `start()`."""
        self.mariadbd = mariadbd
        self.port = free_port()
        self.root = Path(tempfile.mkdtemp(prefix="outbox-mariadb-"))
        self.data = self.root / "data"
        self.log = self.root / "server.log"
        self.user = pwd.getpwuid(os.geteuid()).pw_name
        self.process: subprocess.Popen[bytes] | None = None
        try:
            self._run(
                install_db,
                "--no-defaults",
                f"--datadir={self.data}",
                f"--user={self.user}",
                "--auth-root-authentication-method=normal",
                "--skip-test-db",
                "--skip-name-resolve",
            )
        except BaseException:
            shutil.rmtree(self.root, ignore_errors=True)
            raise

    def url(self, database: str = "mysql") -> str:
        """A SQLAlchemy URL for `database` on this server (PyMySQL, TCP)."""
        return f"mysql+pymysql://root@127.0.0.1:{self.port}/{database}"

    def start(self) -> None:
        """Start the server and wait until it accepts connections."""
        command = [
            str(self.mariadbd),
            "--no-defaults",
            f"--datadir={self.data}",
            f"--user={self.user}",
            f"--port={self.port}",
            "--bind-address=127.0.0.1",
            f"--socket={self.root / 'mariadb.sock'}",
            f"--pid-file={self.root / 'mariadb.pid'}",
            f"--log-error={self.log}",
            *SETTINGS,
        ]
        self.process = subprocess.Popen(command, cwd=self.root, stdin=subprocess.DEVNULL)
        self.wait_accepting()

    def restart(self) -> float:
        """Crash the server (SIGKILL) and start it again; returns when it crashed.

        The returned time.monotonic() is the moment of the crash: faults are timed
        from there, not from when the server is back.
        """
        crashed = time.monotonic()
        self.halt()
        self.start()
        return crashed

    def create_database(self, name: str) -> str:
        """Create database `name`; returns its URL."""
        with self._connect() as conn, conn.cursor() as cursor:
            cursor.execute(f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4")
        return self.url(name)

    def accepting(self) -> bool:
        """Whether a new session can run a query now."""
        if self.process is not None and self.process.poll() is not None:
            raise AssertionError(f"mariadbd exited with {self.process.returncode}")
        try:
            with self._connect() as conn, conn.cursor() as cursor:
                cursor.execute("SELECT 1")
        except pymysql.err.OperationalError:
            return False
        return True

    def _connect(self) -> pymysql.Connection[pymysql.cursors.Cursor]:
        return pymysql.connect(
            host="127.0.0.1", port=self.port, user="root", connect_timeout=2, autocommit=True
        )

    def halt(self) -> None:
        """SIGKILL mariadbd, if it runs, and reap it."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=START_TIMEOUT)
        self.process = None

    def _run(self, tool: Path, *args: str) -> None:
        done = subprocess.run(
            [str(tool), *args],
            cwd=self.root,
            capture_output=True,
            text=True,
            timeout=START_TIMEOUT + 30,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(
                f"{tool.name} {' '.join(args)} exited with {done.returncode}:\n"
                f"{done.stdout}\n{done.stderr}"
            )
