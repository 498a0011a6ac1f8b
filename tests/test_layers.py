"""The layers contract (pyproject's [tool.importlinter]) holds, and it can fail.

`make test` runs lint-imports on the real contract. Here the same contract
without its exceptions for the command line must break: outbox.cli lives in
the outbox package and imports the relay and the receiver, so a contract that
passes without those exceptions would not be checking anything.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def contracts_file(tmp_path: Path, *, keep_exceptions: bool) -> Path:
    """The project's import-linter settings as a file of their own, optionally stripped."""
    settings = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    lines = ["[tool.importlinter]", f"root_packages = {settings['root_packages']!r}"]
    for contract in settings["contracts"]:
        lines.append("[[tool.importlinter.contracts]]")
        for key, value in contract.items():
            if key == "ignore_imports" and not keep_exceptions:
                continue
            lines.append(f"{key} = {value!r}")
    path = tmp_path / "contracts.toml"
    path.write_text("\n".join(lines).replace("'", '"') + "\n")
    return path


def lint(config: Path) -> subprocess.CompletedProcess[str]:
    """Run lint-imports on the project with `config`."""
    return subprocess.run(
        [str(LINT_IMPORTS), "--config", str(config), "--no-cache"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )


def test_the_layers_hold(tmp_path: Path) -> None:
    result = lint(contracts_file(tmp_path, keep_exceptions=True))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def test_without_the_command_lines_exceptions_the_layers_break(tmp_path: Path) -> None:
    result = lint(contracts_file(tmp_path, keep_exceptions=False))
    assert result.returncode != 0, result.stdout
    assert "BROKEN" in result.stdout
    assert "outbox.cli" in result.stdout
