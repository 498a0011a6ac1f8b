"""Where a Worker's time goes: one Worker process draining no-op tasks, sampled by py-spy.

Run: .venv/bin/python -m benchmarks.profile_worker [--tasks 20000] [--out PATH]

py-spy (the `bench` extra) samples every thread of the process, the handler
threads included, while it drains a prefilled queue on a fresh PostgreSQL
database. Printed: the share of samples under each function (inclusive), for
the functions of this product, SQLAlchemy and psycopg that take the most.
"""

from __future__ import annotations

import argparse
import collections
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import outbox
from benchmarks.relay_bench import ROOT, fresh_database, log
from benchmarks.task_throughput import CONCURRENCY, noop, prefill_tasks, tasks_left
from outbox.tasks import TaskQueue
from outbox.worker import Worker

SAMPLES_PER_SECOND = 500
SHOWN = 40


def drain_once(url: str) -> None:
    """In the sampled process: one Worker drains the queue, then returns."""
    engine = outbox.create_engine(url)
    with TaskQueue(url, lease=30) as queue:
        worker = Worker(queue, noop, owner="profiled", concurrency=CONCURRENCY, poll_interval=0.05)

        def stop_when_drained() -> None:
            pause = threading.Event()
            while tasks_left(engine):
                pause.wait(0.01)
            worker.stop()

        threading.Thread(target=stop_when_drained, daemon=True).start()
        started = time.monotonic()
        worker.run(install_signal_handlers=False)
        log(f"drained in {time.monotonic() - started:.1f} s")
    engine.dispose()


def summarize(raw: Path, shown: int = SHOWN) -> str:
    """Inclusive share of samples per function, from py-spy's raw (collapsed) output."""
    inclusive: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if "importlib._bootstrap" in stack:
            continue  # the interpreter starting, not the Worker
        samples = int(count)
        total += samples
        seen = set()
        for frame in stack.split(";"):
            # "function (path/to/module.py:line)" -> "function (module.py)"
            name, _, where = frame.partition(" (")
            key = f"{name} ({where.rsplit('/', 1)[-1].split(':')[0]})"
            if key not in seen:
                seen.add(key)
                inclusive[key] += samples
    rows = [f"{samples / total:6.1%}  {key}" for key, samples in inclusive.most_common(shown)]
    header = f"{total} samples of the thread holding the interpreter lock (imports left out)"
    return header + "\n" + "\n".join(rows)


def profile(tasks: int) -> str:
    """Prefill `tasks`, sample one Worker draining them with py-spy; the summary."""
    spy = shutil.which("py-spy", path=str(Path(sys.executable).parent))
    if spy is None:
        raise RuntimeError("py-spy is missing: run `.venv/bin/pip install -e '.[dev,bench]'`")
    with fresh_database() as url, tempfile.TemporaryDirectory() as tmp:
        prefill_tasks(url, tasks)
        raw = Path(tmp) / "samples.txt"
        sampling = ["--format", "raw", "--rate", str(SAMPLES_PER_SECOND), "--output", str(raw)]
        # Only the thread holding the interpreter lock: where the CPU goes, not who waits.
        sampling += ["--gil", "--nonblocking"]
        command = [sys.executable, "-m", "benchmarks.profile_worker", "--drain", url]
        subprocess.run(
            [spy, "record", *sampling, "--", *command],
            cwd=ROOT,
            check=True,
            stdout=subprocess.DEVNULL,
        )
        return summarize(raw)


def main(argv: list[str] | None = None) -> int:
    """Profile one draining Worker and print the summary."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.profile_worker")
    parser.add_argument("--tasks", type=int, default=20_000)
    parser.add_argument("--out", help="also write the summary here")
    parser.add_argument("--drain", help=argparse.SUPPRESS)  # the sampled child's own mode
    args = parser.parse_args(argv)
    if args.drain:
        drain_once(args.drain)
        return 0
    summary = profile(args.tasks)
    print(summary)
    if args.out:
        Path(args.out).write_text(summary + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
