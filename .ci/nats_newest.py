"""Run the NATS tests on the newest nats-py the `nats` extra allows, not the dev pin.

    .venv/bin/python .ci/nats_newest.py [--keep] [pytest arguments]

The relay's fast NATS client (relay/transports/nats_client.py) overrides private methods
of nats-py's client, checked at first use; the suite runs on the version the dev extra
pins, while users get any release the extra allows. This installs the checkout (editable,
with the fast and nats extras) and the dev extra's tools but nats-py into a clean venv,
resolved to the highest versions allowed, prints the nats-py version it got, and runs
the relay's NATS tests (the fast client's guard among them) and the receiver's NATS
consumer tests there against the local NATS server. The exit status is pytest's.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

from package_check import clean_env  # beside this file: the same clean environment
from uv import find_uv_bin

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
TESTS = [
    "tests/relay/test_relay_nats.py",
    "tests/relay/test_nats_wire.py",
    "tests/relay/test_nats_headers.py",
    "tests/receiver/test_consume_nats.py",
    "tests/receiver/test_consume_nats_forgery.py",
    "tests/receiver/test_consume_nats_hostile.py",
]
"""What depends on nats-py: the relay's transport and fast client, the receiver's consumer."""


def requirement_name(spec: str) -> str:
    """The distribution name a requirement names."""
    found = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", spec)
    assert found is not None, spec
    return found[0].lower().replace("_", "-")


def requirements() -> list[str]:
    """The checkout with its fast and nats extras, and the dev extra but its nats-py pin."""
    dev = PYPROJECT["project"]["optional-dependencies"]["dev"]
    return ["-e", f"{ROOT}[fast,nats]", *(s for s in dev if requirement_name(s) != "nats-py")]


def main() -> int:
    """Build the venv, say which nats-py it holds, run the tests; the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", action="store_true", help="keep the venv")
    args, pytest_args = parser.parse_known_args()  # the rest is pytest's
    work = Path(tempfile.mkdtemp(prefix="outbox-nats-newest-"))
    venv = work / "venv"
    python = venv / "bin" / "python"
    env = clean_env(venv)
    uv = find_uv_bin()
    try:
        subprocess.run([uv, "venv", "--no-config", "--python", sys.executable, venv], check=True)
        install: list[str | Path] = [uv, "pip", "install", "--no-config", "--python", python]
        subprocess.run(
            [*install, "--resolution", "highest", *requirements()], check=True, env=env, cwd=ROOT
        )
        version = subprocess.run(
            [python, "-c", "import importlib.metadata as m; print(m.version('nats-py'))"],
            check=True,
            capture_output=True,
            text=True,
            env=env,
        ).stdout.strip()
        print(f"nats tests on the newest nats-py the nats extra allows: nats-py {version}")
        tests: list[str | Path] = [
            python,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-q",
            *TESTS,
            *pytest_args,
        ]
        return subprocess.run(tests, env=env, cwd=ROOT, check=False).returncode
    finally:
        if args.keep:
            print(f"kept: {venv}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
