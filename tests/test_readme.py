"""The README's quickstart and the tutorial's code, run as written.

The quickstart's blocks run in document order in an empty directory, as a reader
would: the Python block saved as `app.py` and run, the TOML block saved as
`relay.toml`, and each shell line run with the `outbox` of this environment (a line
ending in `&` started in the background). One substitution only: the receiver's port
8000 becomes a free port, so that two runs cannot collide. Then both orders' messages
must reach the receiver, each once, with its own reply_id and body: a quickstart that
published before the order had an id (`order-None:confirmed`) fails here.

The tutorial's Python blocks run the same way, one after the other in one file.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.receiver_helpers import free_port, stored_receipts, wait_until

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
TUTORIAL = ROOT / "docs" / "tutorial.md"
README_PORT = "8000"
FENCE = re.compile(r"^```(\w+)\n(.*?)^```", re.M | re.S)
# Starting, delivering and storing take a second or two; a loaded machine may take more.
DELIVERY_DEADLINE = 90.0


def section(text: str, heading: str) -> str:
    """The text under `heading` up to the next heading of the same level."""
    start = text.index(heading + "\n")
    level = heading.split(" ")[0]
    end = text.find(f"\n{level} ", start + len(heading))
    return text[start : end if end != -1 else len(text)]


def blocks(text: str) -> list[tuple[str, str]]:
    """(language, code) of each fenced block, in order."""
    return [(match.group(1), match.group(2)) for match in FENCE.finditer(text)]


def environment() -> dict[str, str]:
    """This environment with its `outbox` and `python` first on PATH."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


@pytest.fixture
def background() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Processes a block started with `&`; stopped (SIGTERM, then SIGKILL) at the end."""
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for process in started:
        process.send_signal(signal.SIGTERM)
    for process in started:
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def run_shell(code: str, cwd: Path, port: str, background: list[subprocess.Popen[bytes]]) -> None:
    """Each line of a shell block, the port substituted; `&` lines in the background."""
    for line in code.splitlines():
        line = line.strip().replace(README_PORT, port)
        if not line or line.startswith("#"):
            continue
        if line.endswith("&"):
            with (cwd / f"background-{len(background)}.log").open("wb") as log:
                background.append(
                    subprocess.Popen(
                        ["bash", "-c", "exec " + line.removesuffix("&")],
                        cwd=cwd,
                        env=environment(),
                        stdout=log,
                        stderr=subprocess.STDOUT,
                    )
                )
        else:
            done = subprocess.run(
                ["bash", "-c", line], cwd=cwd, env=environment(), capture_output=True, check=False
            )
            assert done.returncode == 0, f"{line}: {done.stderr.decode()}"


def messages_sent(cwd: Path) -> int:
    """What `outbox status --json` counts as sent in the quickstart's database."""
    done = subprocess.run(
        ["outbox", "status", "--json", "--db", "sqlite:///app.db"],
        cwd=cwd,
        env=environment(),
        capture_output=True,
        check=True,
    )
    return int(json.loads(done.stdout)["messages"]["sent"])


def test_the_quickstart_delivers_each_order_once(
    tmp_path: Path, background: list[subprocess.Popen[bytes]]
) -> None:
    quickstart = section(README.read_text(encoding="utf-8"), "## Quickstart")
    port = str(free_port())
    kinds = []
    for kind, code in blocks(quickstart):
        kinds.append(kind)
        if kind == "python":
            (tmp_path / "app.py").write_text(code, encoding="utf-8")
            subprocess.run([sys.executable, "app.py"], cwd=tmp_path, env=environment(), check=True)
        elif kind == "toml":
            (tmp_path / "relay.toml").write_text(code.replace(README_PORT, port), "utf-8")
        elif kind == "sh":
            run_shell(code, tmp_path, port, background)
    assert kinds == ["python", "toml", "sh", "sh"], "the test expects the quickstart's shape"
    receiver_db = f"sqlite:///{tmp_path / 'receiver.db'}"
    # Read the receiver's table in-process: an `outbox status` per poll would cost a
    # second of CPU each. Once both are stored, the relay settles them as sent.
    wait_until(lambda: len(stored_receipts(receiver_db)) >= 2, DELIVERY_DEADLINE, "2 receipts")
    deadline = time.monotonic() + DELIVERY_DEADLINE
    while messages_sent(tmp_path) != 2:
        assert time.monotonic() < deadline, "outbox status never showed both messages sent"
    receipts = stored_receipts(receiver_db)
    assert {reply_id: json.loads(body) for reply_id, body in receipts.items()} == {
        "order-1:confirmed": {"order": 1, "total": "17.00"},
        "order-2:confirmed": {"order": 2, "total": "4.50"},
    }


def test_the_tutorial_runs_as_written(tmp_path: Path) -> None:
    code = [code for kind, code in blocks(TUTORIAL.read_text(encoding="utf-8")) if kind == "python"]
    assert code, "the tutorial has no Python block"
    (tmp_path / "tutorial.py").write_text("\n\n".join(code), encoding="utf-8")
    done = subprocess.run(
        [sys.executable, "tutorial.py"], cwd=tmp_path, env=environment(), capture_output=True
    )
    assert done.returncode == 0, done.stderr.decode()
