"""The tracing benchmark's parts: the OTLP sink, and the three ways it starts processes."""

from __future__ import annotations

import os
import subprocess

import httpx
import pytest

from benchmarks import launcher, trace_cost
from benchmarks.otlp_sink import TRACES_PATH, otlp_sink


def test_the_sink_answers_and_counts_trace_exports_only() -> None:
    with otlp_sink() as sink:
        with httpx.Client(base_url=sink.endpoint) as client:
            assert client.post(TRACES_PATH, content=b"\x0a\x02ab").status_code == 200
            assert client.post(TRACES_PATH, content=b"xyz").status_code == 200
            assert client.post("/v1/metrics", content=b"12345").status_code == 404
        assert sink.exports.snapshot() == (2, 7)


def test_a_launcher_puts_its_pythonpath_first_and_keeps_the_inherited_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PYTHONPATH", "/inherited")
    started = launcher.Launcher("t", prefix=("wrapper",), env={"PYTHONPATH": "/ours", "X": "1"})
    env = started.environment()
    assert env["PYTHONPATH"] == os.pathsep.join(("/ours", "/inherited"))
    assert env["X"] == "1"
    assert started.command("-m", "m")[0] == "wrapper"
    assert launcher.current() is launcher.PLAIN
    with launcher.launching(started):
        assert launcher.current() is started
    assert launcher.current() is launcher.PLAIN


def test_each_way_of_starting_gives_the_tracing_it_is_named_after() -> None:
    trace_cost.check_launchers()  # raises naming the one that differs


def test_an_exporting_process_sends_its_spans_to_the_sink_by_the_time_it_ends() -> None:
    with otlp_sink() as sink:
        exporting = trace_cost.exporting(sink.endpoint)
        # One span, ended well before the batch processor's 5 s schedule: flushed at exit.
        script = "from opentelemetry import trace; trace.get_tracer('t').start_span('s').end()"
        subprocess.run(
            exporting.command("-c", script),
            env=exporting.environment(),
            check=True,
            timeout=60,
        )
        requests, size = sink.exports.snapshot()
    assert requests >= 1
    assert size > 0


def test_an_exporting_launcher_passes_the_command_its_options_untouched() -> None:
    with otlp_sink() as sink:
        exporting = trace_cost.exporting(sink.endpoint)
        # `--config` is the relay's; the wrapper must not read it as one of its own.
        done = subprocess.run(
            exporting.command("-c", "import sys; print(sys.argv[1:])", "--config", "relay.toml"),
            env=exporting.environment(),
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        )
    assert done.stdout.strip() == "['--config', 'relay.toml']"
