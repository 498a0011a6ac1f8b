"""Test what users install: build the sdist and the wheel, check the wheel's contents, then
install the wheel into clean venvs and run the command and the package tests there.

    .venv/bin/python .ci/package_check.py [--keep]

The venvs: no extras; each user extra alone; and every extra at the lowest versions the
lower bounds in pyproject.toml allow (the bounds made direct requirements and resolved
with uv's lowest-direct). In each: `outbox --help`, `outbox --version` and `outbox demo`
with only the package's own dependencies installed, then pytest and httpx are added and
tests/package runs from a copy outside the checkout, so it can only import the installed
package (its first test asserts that). Every venv runs to the end; the summary names each
step that failed, and the exit status is 1 if any did.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import tomllib
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from uv import find_uv_bin

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
DISTRIBUTION = PYPROJECT["project"]["name"]
USER_EXTRAS = ("fast", "nats", "rabbitmq", "otel", "mysql")
"""The extras a user installs; `dev` and `bench` are the project's own."""
PACKAGES = ("outbox", "relay", "receiver", "outbox_cli")
MIGRATIONS = ("alembic", "outbox/_alembic")
"""Where the migrations are in the checkout, and where pyproject's force-include puts them."""
SMOKE_TOOLS = ("pytest", "httpx")
"""What tests/package needs beside the package: taken at the dev extra's versions."""
SMOKE_TESTS = ROOT / "tests" / "package"
UNDER_TEST_ENV = "OUTBOXDEV_PACKAGE_UNDER_TEST"
"""tests/package/conftest.py: the site-packages folder the packages must be imported from."""
EXTRAS_ENV = "OUTBOXDEV_PACKAGE_EXTRAS"
"""The extras the venv under test installed, comma-separated: a test of an extra's takes
that, not what happens to import, as the truth (an extra that lost its package fails)."""
LOWEST_LISTING = "versions at the lower bounds"
OUTPUT_TAIL = 60
"""Lines of a failed step's output the summary repeats."""


@dataclass
class Step:
    """One thing done in one venv, and how it went."""

    venv: str
    name: str
    seconds: float
    ok: bool
    output: str = ""


@dataclass
class Venv:
    """A clean venv: what to install into it, and how to resolve it."""

    name: str
    extras: tuple[str, ...]
    lowest: bool = False
    steps: list[Step] = field(default_factory=list)


def run(command: Sequence[str | Path], cwd: Path, env: dict[str, str], timeout: float) -> Step:
    """Run `command`; a Step (its venv and name filled in by the caller) with its output."""
    started = time.monotonic()
    try:
        done = subprocess.run(
            [str(part) for part in command],
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=timeout,
            check=False,
        )
        ok, output = done.returncode == 0, done.stdout
        if not ok:
            output += f"\n(exit status {done.returncode})"
    except subprocess.TimeoutExpired as exc:
        partial = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else ""
        ok, output = False, f"{partial}\n(killed after {timeout:.0f}s)"
    return Step("", "", time.monotonic() - started, ok, output)


def clean_env(venv: Path | None = None) -> dict[str, str]:
    """The environment without this venv, Python paths or OUTBOX_* settings; with `venv`'s
    scripts first on PATH."""
    dropped = ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "UV_PROJECT")
    env = {
        name: value
        for name, value in os.environ.items()
        if name not in dropped and not name.startswith("OUTBOX_")
    }
    path = [p for p in env.get("PATH", "").split(os.pathsep) if Path(p) != Path(sys.prefix) / "bin"]
    if venv is not None:
        env["VIRTUAL_ENV"] = str(venv)
        path.insert(0, str(venv / "bin"))
    env["PATH"] = os.pathsep.join(path)
    return env


def uv(*args: str | Path) -> list[str | Path]:
    """A uv command that reads no uv.toml or pyproject settings of ours or the machine's."""
    return [find_uv_bin(), *args[:1], "--no-config", *args[1:]]


def requirement_name(spec: str) -> str:
    """The distribution name a requirement names."""
    found = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", spec)
    assert found is not None, spec
    return found[0].lower().replace("_", "-")


def dev_requirement(name: str) -> str:
    """The dev extra's requirement for `name` (pytest==..., httpx>=...)."""
    for spec in PYPROJECT["project"]["optional-dependencies"]["dev"]:
        if requirement_name(spec) == name:
            return str(spec)
    raise SystemExit(f"package check: the dev extra has no requirement for {name}")


def lower_bounds() -> list[str]:
    """Every runtime requirement and every user extra's, as pyproject states them."""
    project = PYPROJECT["project"]
    extras = project["optional-dependencies"]
    return [*project["dependencies"], *(spec for extra in USER_EXTRAS for spec in extras[extra])]


def build(work: Path) -> tuple[Path, Path]:
    """The sdist and the wheel, the wheel built from the sdist as a user's pip would."""
    dist = work / "dist"
    step = run(uv("build", "--out-dir", dist, ROOT), work, clean_env(), timeout=600)
    if not step.ok:
        raise SystemExit(f"package check: the build failed:\n{step.output}")
    [sdist] = dist.glob("*.tar.gz")
    [wheel] = dist.glob("*.whl")
    return sdist, wheel


def tracked(folder: str) -> set[str]:
    """The files git tracks under `folder`, relative to it."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--", folder],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    return {name.removeprefix(folder + "/") for name in listed.split("\0") if name}


def source_version() -> str:
    """outbox.__version__, read from the source the way the build reads it."""
    found = re.search(
        r'^__version__ = "([^"]+)"', (ROOT / "outbox" / "__init__.py").read_text(), re.M
    )
    assert found is not None, "outbox/__init__.py has no __version__"
    return found[1]


def wheel_problems(wheel: Path) -> list[str]:
    """What is wrong with the wheel's files and metadata; empty when nothing is."""
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        info = {name.split("/", 1)[1]: name for name in names if ".dist-info/" in name}
        metadata = archive.read(info["METADATA"]).decode() if "METADATA" in info else ""
        entry_points = (
            archive.read(info["entry_points.txt"]).decode() if "entry_points.txt" in info else ""
        )
    shipped = {name for name in names if ".dist-info/" not in name}
    # Exactly the tracked sources: a template, style sheet or migration left out fails here,
    # and so does anything that is not the product (tests, benchmarks, examples, caches).
    expected = {f"{package}/{name}" for package in PACKAGES for name in tracked(package)}
    source, target = MIGRATIONS
    expected |= {f"{target}/{name}" for name in tracked(source)}
    expected |= {f"{package}/py.typed" for package in PACKAGES}
    problems = [f"missing from the wheel: {name}" for name in sorted(expected - shipped)]
    problems += [
        f"in the wheel but not a tracked source: {name}" for name in sorted(shipped - expected)
    ]
    needed = [
        f"Name: {DISTRIBUTION}",
        f"Version: {source_version()}",
        "License-Expression: ",
        "Project-URL: Source, ",
        "Project-URL: Changelog, ",
        "Keywords: ",
        "Classifier: Typing :: Typed",
        "Requires-Python: ",
    ]
    problems += [f"METADATA lacks {line!r}" for line in needed if line not in metadata]
    if "outbox = outbox_cli:main" not in entry_points:
        problems.append("entry_points.txt lacks the `outbox` command")
    return problems


def sdist_problems(sdist: Path) -> list[str]:
    """What the sdist lacks that a build from it, or a reader of it, needs."""
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    needed = ["pyproject.toml", "README.md", "CHANGELOG.md", "alembic/env.py", "outbox/py.typed"]
    return [f"missing from the sdist: {name}" for name in needed if name not in names]


def check_venv(venv: Venv, wheel: Path, work: Path, smoke: Path) -> None:
    """Install the wheel into a fresh venv and run the command and the package tests there."""
    home = work / "venvs" / venv.name.replace(" ", "-")
    scratch = work / "scratch" / venv.name.replace(" ", "-")
    scratch.mkdir(parents=True)
    env = clean_env(home)

    def step(name: str, command: Sequence[str | Path], timeout: float = 600) -> bool:
        print(f"  [{venv.name}] {name} ...", flush=True)
        done = run(command, scratch, env, timeout)
        done.venv, done.name = venv.name, name
        venv.steps.append(done)
        result = "ok" if done.ok else "FAILED"
        print(f"  [{venv.name}] {name}: {result} in {done.seconds:.1f}s", flush=True)
        return done.ok

    target = f"{wheel}[{','.join(venv.extras)}]" if venv.extras else str(wheel)
    install = uv("pip", "install", "--python", home / "bin" / "python", target)
    if venv.lowest:
        bounds = work / "lower-bounds.txt"
        bounds.write_text("\n".join(lower_bounds()) + "\n", encoding="utf-8")
        install += ["--resolution", "lowest-direct", "-r", bounds]
    python = home / "bin" / "python"
    if not (
        step("create venv", uv("venv", "--python", sys.executable, home))
        and step("install the wheel", install)
        and step("dependencies consistent", uv("pip", "check", "--python", python))
    ):
        return
    if venv.lowest:
        # Quiet: uv's "Using Python ..." line would come before the JSON in the output.
        listed = uv("pip", "list", "--quiet", "--format", "json", "--python", python)
        step(LOWEST_LISTING, listed)
    # Before pytest and httpx are there, which could bring a dependency the package forgot.
    step("outbox --help", ["outbox", "--help"], timeout=120)
    step("outbox --version", ["outbox", "--version"], timeout=120)
    step("outbox demo", ["outbox", "demo"], timeout=600)
    tools = [dev_requirement(name) for name in SMOKE_TOOLS]
    if not step("install pytest and httpx", uv("pip", "install", "--python", python, *tools)):
        return
    env[UNDER_TEST_ENV] = run(
        [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        scratch,
        env,
        timeout=120,
    ).output.strip()
    env[EXTRAS_ENV] = ",".join(venv.extras)
    step(
        "package tests (tests/package)",
        [python, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--rootdir", smoke, smoke],
    )


def copy_smoke_tests(work: Path) -> Path:
    """tests/package copied where nothing of the checkout is importable, with the suite's
    pytest settings (warnings are errors) but not its paths."""
    smoke = work / "package-tests"
    shutil.copytree(SMOKE_TESTS, smoke, ignore=shutil.ignore_patterns("__pycache__"))
    options = PYPROJECT["tool"]["pytest"]["ini_options"]
    lines = ["[pytest]", f"addopts = {' '.join(options['addopts'])}", "filterwarnings ="]
    lines += [f"    {rule}" for rule in options["filterwarnings"]]
    (smoke / "pytest.ini").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return smoke


def bounds_table(listing: str) -> str:
    """Each bounded requirement beside the version installed for it (from `uv pip list`)."""
    installed = {requirement_name(entry["name"]): entry["version"] for entry in json.loads(listing)}
    rows = []
    for spec in lower_bounds():
        name = requirement_name(spec)
        rows.append(f"  {spec.split(';')[0]:<36} {installed.get(name, 'not installed')}")
    return "\n".join(rows)


def summary(venvs: Sequence[Venv], problems: Sequence[str], seconds: float) -> bool:
    """Print every step's result and each failure's output; True when all passed."""
    print("\npackage check summary")
    for problem in problems:
        print(f"  FAILED wheel/sdist contents: {problem}")
    failed = [step for venv in venvs for step in venv.steps if not step.ok]
    for venv in venvs:
        for step in venv.steps:
            result = "ok" if step.ok else "FAILED"
            print(f"  {venv.name:<10} {step.name:<32} {result:<7} {step.seconds:7.1f}s")
    for venv in venvs:
        for step in venv.steps:
            if step.name == LOWEST_LISTING and step.ok:
                print(f"\nvenv '{venv.name}' resolved pyproject's bounds to:")
                print(bounds_table(step.output))
    for step in failed:
        tail = "\n".join(step.output.rstrip().splitlines()[-OUTPUT_TAIL:])
        print(f"\n=== FAILED in venv '{step.venv}': {step.name} ===\n{tail}")
    passed = not failed and not problems
    verdict = "passed" if passed else f"FAILED ({len(failed) + len(problems)} problems)"
    print(f"\npackage check {verdict} in {seconds:.0f}s")
    return passed


def main() -> int:
    """Build, check the contents, check each venv; the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", action="store_true", help="keep the work folder")
    args = parser.parse_args()
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="outbox-package-check-"))
    venvs = [Venv("no extras", ())]
    venvs += [Venv(extra, (extra,)) for extra in USER_EXTRAS]
    venvs.append(Venv("lowest", USER_EXTRAS, lowest=True))
    try:
        print(f"package check in {work}: building the sdist and the wheel", flush=True)
        sdist, wheel = build(work)
        problems = wheel_problems(wheel) + sdist_problems(sdist)
        smoke = copy_smoke_tests(work)
        for venv in venvs:
            print(f"venv '{venv.name}'", flush=True)
            check_venv(venv, wheel, work, smoke)
    finally:
        if args.keep:
            print(f"kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    return 0 if summary(venvs, problems, time.monotonic() - started) else 1


if __name__ == "__main__":
    sys.exit(main())
