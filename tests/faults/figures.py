"""Figures of a fault run, appended as JSON lines for docs/explanation/faults.md.

Tests call `record()` after each scenario; nothing is written unless
OUTBOX_FAULTS_REPORT names a file (`python tests/faults/report.py` sets it),
so the table in the docs always comes from a real run.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from faults.invariants import Tally

REPORT_VAR = "OUTBOX_FAULTS_REPORT"


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
        "dead": found.dead,
    }
    with Path(target).open("a", encoding="utf-8") as out:
        out.write(json.dumps(line) + "\n")
