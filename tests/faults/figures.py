"""Figures of a fault run, appended as JSON lines for docs/explanation/faults.md.

Tests call `record_then_assert()` at the end of each scenario: the figures the
invariant checker measured are written first, then the invariants asserted, so
a broken run leaves its real figures in the file. Nothing is written unless
OUTBOXDEV_FAULTS_REPORT names a file (`python tests/faults/report.py` sets it),
so the table in the docs always comes from a real run.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from faults.invariants import Tally

REPORT_VAR = "OUTBOXDEV_FAULTS_REPORT"


def record(
    scenario: str,
    backend: str,
    case: str,
    *,
    runs: int,
    kills: int,
    messages: int,
    found: Tally,
) -> None:
    """Append one scenario's figures to the report file, when one is being written."""
    target = os.environ.get(REPORT_VAR)
    if not target:
        return
    line = {
        "scenario": scenario,
        "backend": backend,
        "case": case,
        "runs": runs,
        "kills": kills,
        "messages": messages,
        "lost": found.lost,
        "duplicated": found.duplicated,
        "stuck": found.stuck,
        "unexpected": found.unexpected,
        "orphaned": found.orphaned,
        "dead": found.dead,
        "keyed": found.keyed,
        "out_of_order": found.out_of_order,
    }
    with Path(target).open("a", encoding="utf-8") as out:
        out.write(json.dumps(line) + "\n")


def record_then_assert(
    scenario: str,
    backend: str,
    case: str,
    *,
    runs: int,
    kills: int,
    messages: int,
    found: Tally,
    dead_allowed: bool = False,
) -> None:
    """Record the measured figures (see record), then fail unless the invariants held."""
    record(scenario, backend, case, runs=runs, kills=kills, messages=messages, found=found)
    found.assert_clean(dead_allowed=dead_allowed)
