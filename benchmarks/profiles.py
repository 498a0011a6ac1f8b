"""Where the time goes, sampled by py-spy: a Worker draining tasks, or a relay draining replies.

Run: .venv/bin/python -m benchmarks.profiles worker [--tasks 20000]
     .venv/bin/python -m benchmarks.profiles drain [--messages 200000]
     .venv/bin/python -m benchmarks.profiles nats|rabbitmq [--messages 200000]

py-spy (the `bench` extra) samples the thread holding the interpreter lock in
each process, so the figures say where the CPU goes rather than which threads
wait. `worker`: one Worker process draining prefilled no-op tasks on a fresh
PostgreSQL database. `drain`: the suite's drain (two relays in batch mode into
the reference receiver), one relay and the receiver sampled for a few seconds
mid-drain. `nats`, `rabbitmq`: the same relays draining into that broker
(benchmarks.broker_drain), one relay sampled mid-drain. Printed per process:
the share of samples under each function (inclusive), most first.
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

import sqlalchemy as sa

import outbox
from benchmarks.broker_drain import BATCH, PLACES, RELAYS
from benchmarks.relay_bench import (
    ROOT,
    children_running,
    fresh_database,
    log,
    prefill,
    receiver_process,
    relay_processes,
    undelivered,
)
from benchmarks.task_throughput import CONCURRENCY, noop, prefill_tasks, tasks_left
from outbox.process_gc import tune_for_long_run
from outbox.tasks import TaskQueue
from outbox.worker import Worker

SAMPLES_PER_SECOND = 500
SHOWN = 40
DRAIN_SAMPLE_SECONDS = 4
DRAIN_DEADLINE_SECONDS = 600


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
        tune_for_long_run()  # as `outbox worker` does before it runs
        started = time.monotonic()
        worker.run(install_signal_handlers=False)
        log(f"drained in {time.monotonic() - started:.1f} s")
    engine.dispose()


def summarize(raw: Path, shown: int = SHOWN, seconds: float | None = None) -> str:
    """Inclusive share of samples per function, from py-spy's raw (collapsed) output."""
    inclusive: collections.Counter[str] = collections.Counter()
    total = torn = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            # Sampling without pausing the process (--nonblocking) may read a frame's name
            # while it changes: a name with a line break tears its sample in two.
            torn += 1
            continue
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
    if torn:
        header += f", {torn} torn lines left out"
    if seconds:
        header += f", {total / (seconds * SAMPLES_PER_SECOND):.0%} of {seconds:g} s"
    return header + "\n" + "\n".join(rows)


def py_spy() -> str:
    """The py-spy executable beside this interpreter, or RuntimeError with the install line."""
    spy = shutil.which("py-spy", path=str(Path(sys.executable).parent))
    if spy is None:
        raise RuntimeError("py-spy is missing: run `.venv/bin/pip install -e '.[dev,bench]'`")
    return spy


def sampling(raw: Path) -> list[str]:
    """py-spy's record options: raw output, only the thread holding the interpreter lock."""
    rate = str(SAMPLES_PER_SECOND)
    return ["--format", "raw", "--rate", rate, "--output", str(raw), "--gil", "--nonblocking"]


def worker(tasks: int) -> str:
    """Prefill `tasks`, sample one Worker draining them; the summary."""
    spy = py_spy()
    with fresh_database() as url, tempfile.TemporaryDirectory() as tmp:
        prefill_tasks(url, tasks)
        raw = Path(tmp) / "samples.txt"
        command = [sys.executable, "-m", "benchmarks.profiles", "worker", "--drain", url]
        subprocess.run(
            [spy, "record", *sampling(raw), "--", *command],
            cwd=ROOT,
            check=True,
            stdout=subprocess.DEVNULL,
        )
        return summarize(raw)


def attach(pid: int) -> list[str]:
    """py-spy's options to sample a running process for DRAIN_SAMPLE_SECONDS."""
    return ["--pid", str(pid), "--duration", str(DRAIN_SAMPLE_SECONDS)]


def drained(engine: sa.Engine) -> None:
    """Let the relays finish the backlog (they are stopped after), for at most the deadline."""
    deadline = time.monotonic() + DRAIN_DEADLINE_SECONDS
    pause = threading.Event()
    while undelivered(engine) and time.monotonic() < deadline:
        pause.wait(0.1)


def drain(messages: int) -> str:
    """Sample a relay and the receiver mid-drain of `messages`; both summaries."""
    spy = py_spy()
    with fresh_database() as url, tempfile.TemporaryDirectory() as tmp:
        prefill(url, messages)
        engine = outbox.create_engine(url)
        try:
            with (
                receiver_process(url, Path(tmp)) as target,
                relay_processes(url, target, Path(tmp), 2, "batch", 1000),
            ):
                raws = {name: Path(tmp) / f"{name}.txt" for name in ("relay", "receiver")}
                samplers = [
                    subprocess.Popen(
                        [spy, "record", *sampling(raw), *attach(children_running(name)[0])],
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL,
                    )
                    for name, raw in raws.items()
                ]
                for sampler in samplers:
                    sampler.wait(timeout=DRAIN_DEADLINE_SECONDS)
                drained(engine)
        finally:
            engine.dispose()
        return "\n\n".join(
            f"{name}: {summarize(raw, seconds=DRAIN_SAMPLE_SECONDS)}" for name, raw in raws.items()
        )


def broker(kind: str, messages: int) -> str:
    """Sample a relay mid-drain of `messages` into the broker `kind` (benchmarks.broker_drain)."""
    spy = py_spy()
    with (
        fresh_database() as url,
        tempfile.TemporaryDirectory() as tmp,
        PLACES[kind]() as place,
    ):
        prefill(url, messages)
        engine = outbox.create_engine(url)
        raw = Path(tmp) / "relay.txt"
        try:
            with relay_processes(
                url, place.url, Path(tmp), RELAYS, "batch", BATCH, broker=place.destination
            ):
                subprocess.run(
                    [spy, "record", *sampling(raw), *attach(children_running("relay")[0])],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    timeout=DRAIN_DEADLINE_SECONDS,
                    check=True,
                )
                drained(engine)
        finally:
            engine.dispose()
        return f"relay ({kind}): {summarize(raw, seconds=DRAIN_SAMPLE_SECONDS)}"


def main(argv: list[str] | None = None) -> int:
    """Profile one draining Worker, or a drain, and print the summary."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.profiles")
    parser.add_argument("what", choices=("worker", "drain", "nats", "rabbitmq"))
    parser.add_argument("--tasks", type=int, default=20_000)
    parser.add_argument("--messages", type=int, default=200_000)
    parser.add_argument("--drain", help=argparse.SUPPRESS)  # the sampled Worker's own mode
    args = parser.parse_args(argv)
    if args.drain:
        drain_once(args.drain)
        return 0
    if args.what == "worker":
        print(worker(args.tasks))
    elif args.what == "drain":
        print(drain(args.messages))
    else:
        print(broker(args.what, args.messages))
    return 0


if __name__ == "__main__":
    sys.exit(main())
