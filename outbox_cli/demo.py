"""The end-to-end story, with real processes, real crashes and real HTTP on loopback.

Intake with durable ACKs; a worker process killed at a failpoint mid-commit;
lease expiry and recovery by a second worker under a higher fence; the stale
holder's commit refused; results committed with their replies; a relay
delivering to a receiver process over signed HTTP; that receiver dying right
after its commit (the ACK is lost) and the resend answered as a duplicate.
Every invariant is read back from the databases; any failure exits non-zero.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session

import outbox
from outbox import AuthContext, Claim, Envelope, Fenced, TaskQueue, failpoints, publish
from outbox.redaction import redact
from outbox.worker import Worker
from outbox_cli import demo_reads as reads

SOURCE = "agent-a"
LEASE = 1.0  # seconds: short, so the crashed worker's lease runs out quickly
WAIT = 30.0  # seconds any one step may take before the demo gives up


class InvariantFailed(Exception):
    """A demo invariant did not hold."""


def check(condition: bool, what: str) -> None:
    """Print a passed invariant, or raise when it failed."""
    if not condition:
        raise InvariantFailed(what)
    print(f"   ok  {what}")


def compute(claim: Claim, stop: threading.Event) -> dict[str, Any]:
    """The demo's task handler: squares payload["n"]."""
    return {"square": claim.payload["n"] ** 2}


def wait_for(condition: Callable[[], bool], what: str) -> None:
    """Poll until `condition()` holds; InvariantFailed after WAIT seconds."""
    deadline = time.monotonic() + WAIT
    pause = threading.Event()
    while not condition():
        if time.monotonic() > deadline:
            raise InvariantFailed(f"timed out waiting for {what}")
        pause.wait(0.02)


@dataclass
class Setting:
    """Where the story runs."""

    outbox_url: str
    receiver_url: str
    folder: Path
    run: str  # a token in the demo's ids, so runs on one kept database stay apart


def free_port() -> int:
    """A free loopback port."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def child(*argv: str, failpoint: str | None = None) -> subprocess.Popen[bytes]:
    """`outbox ARGV` as a child process, optionally set to die at `failpoint`."""
    unset = (failpoints.ENV_VAR, failpoints.ACTION_VAR, failpoints.SWITCH_VAR)
    env = {k: v for k, v in os.environ.items() if k not in unset}
    if failpoint is not None:
        env.update(failpoints.environment(failpoint))
    # Our own interpreter and entry point, with arguments the demo built.
    return subprocess.Popen(  # noqa: S603
        [sys.executable, "-m", "outbox_cli", *argv],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


@contextlib.contextmanager
def receiver_process(
    setting: Setting, secret_file: Path, port: int, failpoint: str | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """The reference receiver on loopback; yields once it answers its health check."""
    proc = child(
        *("receiver", "--db", setting.receiver_url, "--port", str(port)),
        *("--secret-file", str(secret_file)),
        failpoint=failpoint,
    )

    def healthy() -> bool:
        if proc.poll() is not None:
            raise InvariantFailed(f"receiver exited early: {proc.communicate()[1].decode()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as answer:
                return bool(answer.status == 200)
        except OSError:
            return False

    try:
        wait_for(healthy, "the receiver to start")
        yield proc
    finally:
        if proc.poll() is None:
            proc.terminate()
        try:
            proc.communicate(timeout=WAIT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()


def story(setting: Setting) -> None:
    """Run the demo story; raises InvariantFailed at the first broken invariant."""
    outbox.upgrade(setting.outbox_url)
    import receiver

    receiver.upgrade(setting.receiver_url)
    refuse_a_database_in_use(setting.outbox_url)
    queue = TaskQueue(setting.outbox_url, allowed_sources=(SOURCE,), lease=LEASE)
    try:
        task_ids = intake(queue, setting.run)
        stale = crash_a_worker(queue, setting)
        recover(queue, task_ids, stale)
        reply_ids = replies_of(queue, task_ids, setting.run)
        deliver(setting, reply_ids)
        summary(setting, task_ids, reply_ids)
    finally:
        queue.close()


class DatabaseInUse(Exception):
    """The demo was pointed at a database that already holds tasks or messages."""


def refuse_a_database_in_use(url: str) -> None:
    """The demo's workers and relay take any pending work: they must find only their own."""
    found = reads.tables_in_use(url)
    if found:
        raise DatabaseInUse(
            f"{url} already holds rows in {' and '.join(found)}: the demo's workers and relay "
            "would take that work too; give it an empty database"
        )


def intake(queue: TaskQueue, run: str) -> list[str]:
    """Three tasks, each ACKed only after its commit; a resend is a duplicate."""
    print("1. intake: three tasks, each ACKed only after its commit")
    source = AuthContext(SOURCE)
    deadline = time.time() + 3600
    acks = [
        queue.receive(source, Envelope(f"{run}-msg-{n}", SOURCE, {"n": n}, deadline))
        for n in range(1, 4)
    ]
    again = queue.receive(source, Envelope(f"{run}-msg-1", SOURCE, {"n": 1}, deadline))
    check(all(a.ack == "stored" and not a.duplicate for a in acks), "three new tasks stored")
    check(again.duplicate and again.task_id == acks[0].task_id, "a resent envelope is a duplicate")
    return [a.task_id for a in acks]


def crash_a_worker(queue: TaskQueue, setting: Setting) -> dict[str, Any]:
    """worker-1, a real process, dies inside its commit; returns what it held."""
    print("2. worker-1 (a process) computes a result and dies before its commit")
    proc = child(
        *("worker", "--db", setting.outbox_url, "--handler", "outbox_cli.demo:compute"),
        *("--owner", f"{setting.run}-worker-1", "--lease", str(LEASE), "--poll-interval", "0.05"),
        failpoint="finish.before_commit",
    )
    try:
        _, err = proc.communicate(timeout=WAIT)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise InvariantFailed("worker-1 never reached its failpoint") from None
    if proc.returncode != failpoints.EXIT_CODE:
        print(err.decode(), file=sys.stderr)
    check(proc.returncode == failpoints.EXIT_CODE, "worker-1 died at finish.before_commit")
    held = reads.task_held_by(queue.engine, f"{setting.run}-worker-1")
    print(f"   worker-1 held task {held['task_id'][:12]}… under fence {held['fence']}")
    check(held["state"] == "running", "its result was not committed: the task is still running")
    return held


def recover(queue: TaskQueue, task_ids: list[str], stale: dict[str, Any]) -> None:
    """worker-2 takes the tasks once the lease runs out; worker-1's late commit is refused."""
    print(f"3. the {LEASE:g} s lease runs out; worker-2 finishes every task")
    worker = Worker(queue, compute, owner="worker-2", poll_interval=0.05)
    thread = threading.Thread(target=worker.run, kwargs={"install_signal_handlers": False})
    thread.start()
    try:
        wait_for(
            lambda: all(queue.task(t)["state"] == "done" for t in task_ids),  # type: ignore[index]
            "worker-2 to finish every task",
        )
    finally:
        worker.stop()
        thread.join(timeout=WAIT)
    recovered = queue.task(stale["task_id"])
    assert recovered is not None
    check(recovered["fence"] > stale["fence"], "the recovered task carries a higher fence")
    print("4. worker-1's late commit, under its old fence")
    late = Claim(stale["task_id"], stale["owner"], stale["fence"], 1, {})
    try:
        queue.finish(late, {"square": -1})
        check(False, "the stale commit is refused")
    except Fenced as exc:
        print(f"   Fenced: {exc}")
        check(True, "the stale commit is refused")
    results = [queue.task(t)["result"] for t in task_ids]  # type: ignore[index]
    check(results == [{"square": n * n} for n in range(1, 4)], "every result is worker-2's")


def replies_of(queue: TaskQueue, task_ids: list[str], run: str) -> list[str]:
    """Exactly one reply per task, plus one a service publishes in its own transaction."""
    print("5. results were committed together with their replies; a service publishes one more")
    with Session(queue.engine) as session, session.begin():
        publish(session, "default", f"{run}-order-17:confirmed", {"order": 17})
    rows = reads.messages_of(queue.engine, task_ids, f"{run}-order-17:confirmed")
    per_task = [row.task_id for row in rows if row.task_id is not None]
    check(sorted(per_task) == sorted(task_ids), "exactly one reply per task")
    return sorted(row.reply_id for row in rows)


def deliver(setting: Setting, reply_ids: list[str]) -> None:
    """The relay posts to a receiver that dies after committing; the resend is a duplicate."""
    from relay import Relay
    from relay.config import make_destination

    secret = "whsec_" + base64.b64encode(secrets.token_bytes(24)).decode()
    secret_file = setting.folder / "receiver-secret"
    secret_file.write_text(secret + "\n", encoding="utf-8")
    port = free_port()
    destination = make_destination(
        f"http://127.0.0.1:{port}/replies", secret=secret, timeout=2, mode="batch"
    )
    relay = Relay(
        setting.outbox_url,
        {"default": destination},
        owner=f"{setting.run}-relay",
        lease=5,
        backoff=0.2,
        backoff_cap=0.5,
        max_attempts=5,
    )
    try:
        print("6. the relay posts the replies; the receiver commits them, then dies (lost ACK)")
        with receiver_process(
            setting, secret_file, port, failpoint="receiver.after_commit"
        ) as dying:
            verdicts = relay.dispatch_once()
            dying.wait(timeout=WAIT)
        check(dying.returncode == failpoints.EXIT_CODE, "the receiver died after its commit")
        check(
            bool(verdicts) and all(v == "retry" for _, v in verdicts),
            "without an ACK the relay keeps every reply for a retry",
        )
        check(
            set(reads.receipt_hashes(setting.receiver_url, reply_ids)) == set(reply_ids),
            "yet the receiver had committed every one of them",
        )
        print("7. the receiver restarts; the relay resends the same reply_ids and bodies")
        with receiver_process(setting, secret_file, port):
            wait_for(
                lambda: (
                    bool(relay.dispatch_once()) and reads.delivered(setting.outbox_url, reply_ids)
                ),
                "the relay to deliver every reply",
            )
    finally:
        relay.close()


def summary(setting: Setting, task_ids: list[str], reply_ids: list[str]) -> None:
    """The final table, and the invariants it shows."""
    held = reads.receipt_hashes(setting.receiver_url, reply_ids)
    sent = reads.delivery_records(setting.outbox_url, reply_ids)
    task_states = reads.task_states(setting.outbox_url, task_ids)
    effect_counts = reads.effect_counts(setting.receiver_url, reply_ids)
    print("8. final states")
    print(f"   {'reply_id':<44} {'task':<6} {'reply':<6} {'attempts':>8} {'effects':>8}")
    for reply_id in reply_ids:
        row = sent[reply_id]
        task = task_states.get(row.task_id, "-") if row.task_id else "-"
        print(
            f"   {reply_id[:43]:<44} {task:<6} {row.state:<6} {row.attempts:>8} "
            f"{effect_counts.get(reply_id, 0):>8}"
        )
    check(set(task_states.values()) == {"done"}, "every task is done")
    check({row.state for row in sent.values()} == {"sent"}, "every reply is sent")
    check(
        all(held.get(r) == sent[r].content_hash for r in reply_ids),
        "the receiver holds each reply with the exact body hash",
    )
    check(
        all(effect_counts.get(r) == 1 for r in reply_ids),
        "exactly one receiver effect per reply, though each was delivered twice",
    )
    check(all(sent[r].attempts == 2 for r in reply_ids), "each reply took two attempts")


def main(argv: list[str] | None = None) -> int:
    """`outbox demo [--keep] [--db URL]`; returns the exit status."""
    parser = argparse.ArgumentParser(prog="outbox demo")
    add_arguments(parser)
    return run(parser.parse_args(argv))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's options."""
    parser.add_argument(
        "--db",
        default=None,
        help="run on this empty database (e.g. postgresql://...) instead of "
        "SQLite files in a temporary folder",
    )
    parser.add_argument("--keep", action="store_true", help="keep the SQLite files afterwards")


def run(args: argparse.Namespace) -> int:
    """Run the story in a folder of its own; returns the exit status."""
    folder = Path(tempfile.mkdtemp(prefix="outbox-demo-"))
    token = secrets.token_hex(3)
    if args.db is None:
        setting = Setting(
            f"sqlite:///{folder / 'outbox.db'}",
            f"sqlite:///{folder / 'receiver.db'}",
            folder,
            token,
        )
    else:
        setting = Setting(args.db, args.db, folder, token)
    print(f"outbox database:   {redact(setting.outbox_url)}")
    print(f"receiver database: {redact(setting.receiver_url)}")
    try:
        story(setting)
    except DatabaseInUse as exc:
        print(f"outbox demo: {exc}", file=sys.stderr)
        return 2
    except InvariantFailed as exc:
        print(f"FAILED: {exc}", file=sys.stderr)
        return 1
    finally:
        if args.keep:
            print(f"kept: {folder}")
        else:
            for path in folder.iterdir():
                path.unlink()
            folder.rmdir()
    print("all invariants held")
    return 0


if __name__ == "__main__":
    sys.exit(main())
