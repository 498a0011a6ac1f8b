"""Run the fault scenarios and write docs/explanation/faults.md from what they recorded.

    .venv/bin/python tests/faults/report.py            # the CI form
    .venv/bin/python tests/faults/report.py --soak     # the long form

The tests append their figures to a JSON-lines file (faults.figures); this
script runs them, and only when every test passed does it replace the table,
so the document always shows a real, green run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
TARGET = ROOT / "docs" / "explanation" / "faults.md"
REPORT_VAR = "OUTBOXDEV_FAULTS_REPORT"
COUNTS = (
    "runs",
    "kills",
    "messages",
    "lost",
    "duplicated",
    "stuck",
    "unexpected",
    "orphaned",
    "dead",
    "keyed",
    "out_of_order",
)
SCENARIOS = {
    "crash matrix": "processes of the role exit at the failpoint (os._exit), 5 at a time (the "
    "receiver: 1), then a replacement starts without it and the system drains. At a "
    "`*.before_commit` point each process instead stops there (SIGSTOP) and is SIGKILLed "
    "only once the database is seen holding its uncommitted writes (PostgreSQL: a session of "
    "it `idle in transaction` with a transaction id and RowExclusiveLock on the tables the "
    "step writes; MariaDB: an InnoDB transaction of its session that changed rows and holds "
    "write intentions on those tables; SQLite: the write lock held); on PostgreSQL its "
    "transaction is then seen `aborted`, on MariaDB gone. A kill is counted only when it was "
    "seen inside that window",
    "stale lease": "paused by SIGSTOP right after claiming, taken over, resumed by SIGCONT",
    "database": "PostgreSQL sessions terminated, or the test-owned server crashed and "
    "restarted (a PostgreSQL cluster in immediate mode, a MariaDB server by SIGKILL)",
    "network": "a TCP proxy between relay and receiver breaks the connection",
    "broker crash": "relay processes exit at the failpoint (os._exit) 10 times in one drain "
    "into NATS JetStream or RabbitMQ, then a clean relay finishes; an `outbox receiver "
    "consume` process applies the effects throughout. At `relay.before_sent_commit` each is "
    "killed inside its commit window, seen as in the crash matrix",
    "broker outage": "a byte-stream proxy cuts every relay-broker connection 3 times, or a "
    "private nats-server is SIGKILLed and restarted, while a relay and a consumer run",
    "key order": "every message carries an ordering key, half of them one hot key; relays in "
    "batch mode killed mid-batch at each relay failpoint, HTTP receivers killed after their "
    "commit, or JetStream and RabbitMQ consumers killed after their commit and before their "
    "ack, 5 in turn, then a clean one finishes; *out_of_order* read from the order in which "
    "the receiver applied the effects",
    "model": "Hypothesis state machine against an in-memory model",
    "soak": "3 workers, 3 relays and the receiver; a random one SIGKILLed every 0.5-2 s "
    "and restarted while tasks arrive, with a published reply per 4 tasks keyed (half of "
    "them one hot key)",
}


def run_tests(soak: bool, extra: list[str], figures: Path) -> int:
    """Run tests/faults with the figures file set; returns pytest's exit status."""
    command = [sys.executable, "-m", "pytest", "tests/faults", "-q", "-p", "no:cacheprovider"]
    command += ["-n", "3", "--dist", "worksteal"]  # as `make test-faults` runs them
    command += (["--soak"] if soak else []) + extra
    env = {**os.environ, REPORT_VAR: str(figures)}
    return subprocess.call(command, cwd=ROOT, env=env)


def read_figures(figures: Path) -> list[dict[str, Any]]:
    """The recorded lines, in the order the tests wrote them."""
    if not figures.exists():
        return []
    return [json.loads(line) for line in figures.read_text(encoding="utf-8").splitlines()]


def render(lines: list[dict[str, Any]], command: str) -> str:
    """The Markdown document: how it was made, one row per case, totals per backend."""
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    today = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    out = [
        "# Faults: what was broken, and what was lost",
        "",
        f"Written by `{command}` on {today} at commit `{commit or 'unknown'}`.",
        "Do not edit by hand: run the command again.",
        "",
        "Every row ends with the invariant checker (`tests/faults/invariants.py`) reading",
        "the outbox and the receiver after the drain; each test records the figures it",
        "measured before it asserts them. *lost*: an acknowledged task or committed reply",
        "with no outcome, or sent but not received; *duplicated*: more than one receiver",
        "effect for a reply_id; *stuck*: neither finished nor dead after the drain;",
        "*unexpected*: a receipt the outbox never sent, or an",
        "effect without its receipt; *orphaned*: a row whose partner the schema does not",
        "enforce is gone (a task without its inbox row, a reply whose task is gone, a",
        "requeue record without its reply); *out_of_order*: of the *keyed* messages (those",
        "with an ordering key), one whose effect the receiver applied after the effect of a",
        "later message of its destination and key (effects in the table's identity order).",
        "*dead* replies are counted",
        "apart and allowed in two scenarios only: the model, whose lost ACKs and crashes may",
        "spend a reply's whole retry budget, and the database faults, where a reply may end",
        "dead with its reason recorded.",
        "",
        "| scenario | case | backend | " + " | ".join(COUNTS) + " |",
        "| --- | --- | --- | " + " | ".join("---:" for _ in COUNTS) + " |",
    ]
    totals: dict[str, dict[str, int]] = defaultdict(lambda: dict.fromkeys(COUNTS, 0))
    order = list(SCENARIOS)
    lines = sorted(lines, key=lambda x: (order.index(x["scenario"]), x["case"], x["backend"]))
    for line in lines:
        cells = [line["scenario"], line["case"], line["backend"]] + [str(line[k]) for k in COUNTS]
        out.append("| " + " | ".join(cells) + " |")
        for key in COUNTS:
            totals[line["backend"]][key] += int(line[key])
    out += ["", "Totals per backend:", "", "| backend | " + " | ".join(COUNTS) + " |"]
    out.append("| --- | " + " | ".join("---:" for _ in COUNTS) + " |")
    for backend, sums in sorted(totals.items()):
        out.append(f"| {backend} | " + " | ".join(str(sums[k]) for k in COUNTS) + " |")
    out += ["", "Scenarios:", ""]
    out += [f"- **{name}**: {what}." for name, what in SCENARIOS.items()]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Run the scenarios; on success rewrite docs/explanation/faults.md; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--soak", action="store_true", help="the long form of every scenario")
    args, extra = parser.parse_known_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        figures = Path(folder) / "figures.jsonl"
        status = run_tests(args.soak, extra, figures)
        lines = read_figures(figures)
    if status != 0:
        if lines:
            # What the failing run measured, recorded before its assertions: shown, not kept.
            print(render(lines, "a failing run"))
        print(f"fault tests failed (pytest exit {status}); {TARGET} left as it was")
        return 1
    if not lines:
        print("no figures were recorded; is tests/faults empty?")
        return 1
    command = "python tests/faults/report.py" + (" --soak" if args.soak else "")
    TARGET.parent.mkdir(exist_ok=True)
    TARGET.write_text(render(lines, command), encoding="utf-8")
    print(f"wrote {TARGET} ({len(lines)} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
