"""The cost of tracing: the suite's drain and paced live run with the relay and receiver
processes traced, untraced, and without OpenTelemetry at all.

Run: .venv/bin/python -m benchmarks.trace_cost [--quick]

Three ways to start the relay and receiver processes (benchmarks.launcher), nothing else
changed:

- exporting: under `opentelemetry-instrument` (opentelemetry-distro, the dev extra) with
  the standard OTEL_* variables: OTLP over HTTP (protobuf) to a local sink
  (benchmarks.otlp_sink) through the SDK's default batch span processor, metrics and
  logs not exported. A traced run that exported nothing is an error.
- not configured: as every other run starts them; opentelemetry-api is installed (the
  dev extra), no tracer provider is set up.
- not importable: `opentelemetry` blocked in those processes, as in an install without
  the `otel` extra (the sitecustomize of tests/support/without_extras).

Each run checks first, in a process started each way, that the toolkit sees what it
should (configured, not configured, not importable).

One run: drains of a fresh prefill each (2 relays, batch mode, the receiver storing
receipts only, as the suite's drain of ours), every message carrying a creation context
of its own as messages published inside a traced request do: exporting, not configured,
not importable, not configured again, exporting again, so each comparison has a pair in
each order. Then the paced live run (the suite's producers at its pace): exporting, not
configured, exporting again.
"""

from __future__ import annotations

import shutil
import subprocess
import sysconfig
from collections.abc import Callable, Iterable
from typing import Any

from benchmarks import bare_relay
from benchmarks.launcher import Launcher, launching
from benchmarks.otlp_sink import otlp_sink
from benchmarks.relay_bench import (
    ROOT,
    drain_backlog,
    fresh_database,
    live,
    log,
    prefill,
    run_alone,
)

BLOCKER = ROOT / "tests" / "support" / "without_extras"
"""A sitecustomize making the modules WITHOUT_EXTRAS_BLOCKED names unimportable."""

NOT_CONFIGURED = Launcher("not configured")
"""As every other run starts them (benchmarks.launcher.PLAIN), named for the logs."""
NOT_IMPORTABLE = Launcher(
    "not importable",
    env={"PYTHONPATH": str(BLOCKER), "WITHOUT_EXTRAS_BLOCKED": "opentelemetry"},
)
CONFIGURED, UNCONFIGURED, ABSENT = "configured", "not configured", "not importable"

# What the toolkit sees in a process started by a launcher: outbox.tracing's own checks.
PROBE = (
    "from outbox import tracing\n"
    "from outbox.trace_context import otel_trace\n"
    f"print({ABSENT!r} if otel_trace() is None else "
    f"{CONFIGURED!r} if tracing.configured() else {UNCONFIGURED!r})"
)


def instrument_command() -> str:
    """The `opentelemetry-instrument` of our environment, or RuntimeError."""
    found = shutil.which("opentelemetry-instrument", path=sysconfig.get_path("scripts"))
    if found is None:
        raise RuntimeError(
            "opentelemetry-instrument is not installed (opentelemetry-distro, the dev extra)"
        )
    return found


def exporting(endpoint: str) -> Launcher:
    """Processes under opentelemetry-instrument exporting spans to `endpoint` by OTLP/HTTP,
    through the SDK's default batch span processor."""
    return Launcher(
        "exporting",
        # `--` ends the wrapper's own options: without it, argparse takes the relay's
        # `--config` for an ambiguous abbreviation of `--configurator` and exits.
        prefix=(instrument_command(), "--"),
        env={
            "OTEL_SERVICE_NAME": "outbox-benchmark",
            "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
            "OTEL_METRICS_EXPORTER": "none",
            "OTEL_LOGS_EXPORTER": "none",
        },
    )


def tracing_seen(launcher: Launcher) -> str:
    """What the toolkit sees in a process `launcher` starts: CONFIGURED, UNCONFIGURED or
    ABSENT."""
    done = subprocess.run(
        launcher.command("-c", PROBE),
        cwd=ROOT,
        env=launcher.environment(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the {launcher.name} probe failed: {done.stderr[-2000:]}")
    return done.stdout.strip()


def check_launchers() -> None:
    """Each way of starting the processes gives what its runs are named after, or
    RuntimeError: a comparison of two alike would read as tracing costing nothing."""
    if not (BLOCKER / "sitecustomize.py").is_file():
        raise RuntimeError(f"{BLOCKER}/sitecustomize.py is missing")
    with otlp_sink() as sink:
        cases = (
            (exporting(sink.endpoint), CONFIGURED),
            (NOT_CONFIGURED, UNCONFIGURED),
            (NOT_IMPORTABLE, ABSENT),
        )
        for launcher, expected in cases:
            seen = tracing_seen(launcher)
            if seen != expected:
                raise RuntimeError(f"started {launcher.name}, tracing is {seen!r}")


def traced(measure: Callable[[Launcher], dict[str, Any]]) -> dict[str, Any]:
    """`measure` with processes exporting to a sink of its own; its result with the export
    requests and bytes the sink took (`exports`, `export_bytes`), or RuntimeError when
    it took none."""
    with otlp_sink() as sink:
        result = measure(exporting(sink.endpoint))
    # Read once every process has ended: each flushes its last spans on the way out.
    requests, size = sink.exports.snapshot()
    if requests == 0:
        raise RuntimeError(f"a traced run exported no spans: {result}")
    return {**result, "exports": requests, "export_bytes": size}


def drain_with(total: int, launcher: Launcher) -> dict[str, Any]:
    """Our drain (the suite's: bare_relay.RELAYS relays in batch mode, the receiver storing
    receipts only) of a fresh prefill of `total` messages with creation contexts, its
    processes started by `launcher`; it must finish."""
    with fresh_database() as url:
        log(f"  prefill {total} messages with creation contexts")
        prefill(url, total, creation_contexts=True)
        with launching(launcher):
            result = drain_backlog(
                url,
                total,
                "batch",
                bare_relay.RELAYS,
                bare_relay.OURS_BATCH,
                reference_effect=False,
            )
    if not result["complete"]:
        raise RuntimeError(f"the relays did not drain ({launcher.name}): {result}")
    log(f"  {launcher.name}: {result}")
    return result


def live_with(seconds: float, launcher: Launcher) -> dict[str, Any]:
    """The suite's paced live run (its producers at their pace, one relay, the receiver
    storing receipts only) with the relay and receiver started by `launcher`."""
    with launching(launcher):
        result = live(
            seconds,
            bare_relay.LIVE_PRODUCERS,
            bare_relay.LIVE_RELAYS,
            bare_relay.LIVE_RATE,
            reference_effect=False,
        )
    log(f"  {launcher.name}: {result}")
    return result


def drains(total: int) -> dict[str, float]:
    """Drain rates (`drain_<name>`): traced, not configured (`off`), not importable
    (`absent`), not configured again, traced again; each traced drain's exports and their
    bytes."""
    figures: dict[str, float] = {}
    for name in ("traced", "off", "absent", "off_after", "traced_after"):
        if name.startswith("traced"):
            result = traced(lambda launcher: drain_with(total, launcher))
            figures[f"drain_{name}_exports"] = float(result["exports"])
            figures[f"drain_{name}_export_bytes"] = float(result["export_bytes"])
        else:
            result = drain_with(total, NOT_IMPORTABLE if name == "absent" else NOT_CONFIGURED)
        figures[f"drain_{name}"] = float(result["rate"])
    return figures


def live_runs(seconds: float) -> dict[str, float]:
    """Commit-to-receipt quantiles and the producers' rate (`live_<name>_...`): traced, not
    configured (`off`), traced again; each traced run's exports and their bytes."""
    figures: dict[str, float] = {}
    for name in ("traced", "off", "traced_after"):
        if name.startswith("traced"):
            result = traced(lambda launcher: live_with(seconds, launcher))
            figures[f"live_{name}_exports"] = float(result["exports"])
            figures[f"live_{name}_export_bytes"] = float(result["export_bytes"])
        else:
            result = live_with(seconds, NOT_CONFIGURED)
        for figure in ("p50_ms", "p99_ms", "rate"):
            figures[f"live_{name}_{figure}"] = float(result[figure])
    return figures


def measure(total: int, seconds: float) -> dict[str, float]:
    """One run: the launchers checked, the drains of `total` messages, the live runs of
    `seconds`."""
    check_launchers()
    return drains(total) | live_runs(seconds)


def sizes(quick: bool) -> tuple[int, float]:
    """The suite's drain size and live seconds (benchmarks.suite.Sizes)."""
    return (5_000, 3.0) if quick else (200_000, 10.0)


def run(quick: bool) -> dict[str, float]:
    """One run at the suite's sizes."""
    return measure(*sizes(quick))


def main(argv: Iterable[str] | None = None) -> int:
    """Run once and print the figures as JSON."""
    return run_alone("python -m benchmarks.trace_cost", run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
