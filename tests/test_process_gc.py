"""A service process's collector: start-up heap frozen, young threshold raised, cycles collected."""

from __future__ import annotations

import json
import subprocess
import sys

from outbox.process_gc import YOUNG_THRESHOLD

CHILD = """
import gc, json, weakref
from outbox.process_gc import tune_for_long_run

before = gc.get_threshold()
tune_for_long_run()

class Node:
    pass

# A cycle made after the tuning is still found and freed by the collector.
a, b = Node(), Node()
a.other, b.other = b, a
alive = weakref.ref(a)
del a, b
gc.collect()
print(json.dumps({
    "frozen": gc.get_freeze_count(),
    "before": before,
    "after": gc.get_threshold(),
    "cycle_freed": alive() is None,
}))
"""


def test_tuning_freezes_start_up_and_collects_young_objects_less_often() -> None:
    # In a child: freezing is for the life of a process, which must not be the test runner.
    done = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120, check=True
    )
    figures = json.loads(done.stdout)
    assert figures["frozen"] > 1000, figures
    assert figures["after"] == [YOUNG_THRESHOLD, *figures["before"][1:]], figures
    assert figures["cycle_freed"] is True, figures
