"""A service process's collector: start-up heap frozen, young threshold raised, cycles collected."""

from __future__ import annotations

import json
import subprocess
import sys

from outbox.process_gc import YOUNG_THRESHOLD

CHILD = """
import gc, json, weakref
from outbox.process_gc import YOUNG_THRESHOLD, tune_for_long_run

before = gc.get_threshold()
tune_for_long_run()

class Node:
    pass

collections = []

def count(phase, info):
    if phase == "stop":
        collections.append(info["generation"])

gc.callbacks.append(count)

# A cycle made after the tuning is still found and freed by the collector on its own.
a, b = Node(), Node()
a.other, b.other = b, a
alive = weakref.ref(a)
del a, b
# Below the young threshold the collector leaves it; past it, a young collection frees it.
kept = [[] for _ in range(YOUNG_THRESHOLD // 2)]
early = {"collections": len(collections), "cycle_alive": alive() is not None}
kept += [[] for _ in range(YOUNG_THRESHOLD)]
print(json.dumps({
    "frozen": gc.get_freeze_count(),
    "before": before,
    "after": gc.get_threshold(),
    "early": early,
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
    # Half the threshold of new objects ran no collection (700 would have run several)...
    assert figures["early"] == {"collections": 0, "cycle_alive": True}, figures
    # ...and past the threshold a young collection freed the cycle, with no gc.collect().
    assert figures["cycle_freed"] is True, figures


OWN_PROCESS = """
import gc, json
from outbox_cli import own_process

own_process.tune_if_own_process()  # a command run inside another program's process
hosted = gc.get_freeze_count()
own_process.run_as_command()  # what `outbox ...` and `python -m outbox_cli` mark
own_process.tune_if_own_process()
print(json.dumps({"hosted": hosted, "own": gc.get_freeze_count()}))
"""


def test_only_the_commands_own_process_is_tuned() -> None:
    done = subprocess.run(
        [sys.executable, "-c", OWN_PROCESS], capture_output=True, text=True, timeout=120, check=True
    )
    figures = json.loads(done.stdout)
    assert figures["hosted"] == 0, figures
    assert figures["own"] > 1000, figures
