"""The import contracts (pyproject's [tool.importlinter]) hold, and they can fail.

`make test` runs lint-imports on the real contracts. Here each is shown to check
something: the same layers with the applications (outbox_cli) put at the bottom
must break, as outbox_cli imports the relay and the receiver; and the web stack the
core must not import is found when the command line, which serves the console on
it, is named in the core's place. `import outbox` is also run in a fresh interpreter:
what it loads is what a service that only publishes pays for.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")
WEB_STACK = ("starlette", "uvicorn", "jinja2", "aiohttp")
ABOVE_THE_CORE = ("relay", "receiver", "outbox_cli")


def settings() -> dict[str, Any]:
    """pyproject's [tool.importlinter]."""
    found: dict[str, Any] = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"][
        "importlinter"
    ]
    return found


def contract(name_starts: str) -> dict[str, Any]:
    """The one contract whose name starts so."""
    [found] = [c for c in settings()["contracts"] if c["name"].startswith(name_starts)]
    return dict(found)


def contracts_file(tmp_path: Path, contracts: list[dict[str, Any]]) -> Path:
    """The project's import-linter settings with these contracts, as a file of their own."""
    top = settings()
    lines = [
        "[tool.importlinter]",
        f"root_packages = {top['root_packages']!r}",
        f"include_external_packages = {str(top['include_external_packages']).lower()}",
    ]
    for each in contracts:
        lines.append("[[tool.importlinter.contracts]]")
        lines += [f"{key} = {value!r}" for key, value in each.items()]
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


def test_the_contracts_hold_with_no_exceptions(tmp_path: Path) -> None:
    assert not any("ignore_imports" in c for c in settings()["contracts"])
    result = lint(contracts_file(tmp_path, settings()["contracts"]))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def test_the_layers_break_with_the_applications_at_the_bottom(tmp_path: Path) -> None:
    layers = contract("layers")
    assert layers["layers"][0] == "outbox_cli"
    layers["layers"] = [*layers["layers"][1:], "outbox_cli"]
    result = lint(contracts_file(tmp_path, [layers]))
    assert result.returncode != 0, result.stdout
    assert "BROKEN" in result.stdout
    assert "outbox_cli" in result.stdout


def test_the_web_stack_contract_finds_the_consoles_imports(tmp_path: Path) -> None:
    web = contract("the core imports no web stack")
    assert web["source_modules"] == ["outbox"]
    assert sorted(web["forbidden_modules"]) == sorted(WEB_STACK)
    web["source_modules"] = ["outbox_cli"]
    result = lint(contracts_file(tmp_path, [web]))
    assert result.returncode != 0, result.stdout
    assert "outbox_cli.console" in result.stdout
    assert "starlette" in result.stdout


def test_importing_the_core_loads_no_web_stack_and_nothing_above_it() -> None:
    program = (
        "import json, sys\n"
        "import outbox, outbox.decisions, outbox.operations\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", program], cwd=ROOT, capture_output=True, text=True, check=True
    )
    loaded = json.loads(done.stdout)
    # The probe sees what it must: the core itself, and its database layer.
    assert {"outbox", "outbox.operations", "sqlalchemy"} <= set(loaded)
    roots = {name.split(".", 1)[0] for name in loaded}
    assert not roots & {*WEB_STACK, *ABOVE_THE_CORE}, sorted(roots & {*WEB_STACK, *ABOVE_THE_CORE})


def test_only_a_relay_sending_http_loads_the_http_client() -> None:
    # Every command imports the relay's settings to check a config file; aiohttp is a
    # tenth of a second of each one's start-up, so it waits for the first HTTP request.
    program = (
        "import json, sys\n"
        "import outbox_cli, relay, relay.config\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", program], cwd=ROOT, capture_output=True, text=True, check=True
    )
    loaded = set(json.loads(done.stdout))
    assert {"outbox_cli.receiver", "relay.http_client", "relay.transports.http"} <= loaded
    assert "aiohttp" not in loaded


DRIVERS = "drivers: only outbox.drivers imports psycopg"
PRODUCTS = ("outbox", "relay", "receiver", "outbox_cli")


def importers_of(prefix: str) -> set[str]:
    """The product modules whose source imports `prefix` or a module below it."""
    found = set()
    for package in PRODUCTS:
        for path in (ROOT / package).rglob("*.py"):
            module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
                else:
                    continue
                if any(name == prefix or name.startswith(prefix + ".") for name in names):
                    found.add(module.removesuffix(".__init__"))
    return found


def allowed(module: str, importers: list[str]) -> bool:
    """Whether `module` is one of `importers` or inside one of them."""
    return any(module == each or module.startswith(each + ".") for each in importers)


def test_the_drivers_contract_breaks_when_the_drivers_are_not_allowed(tmp_path: Path) -> None:
    drivers = contract(DRIVERS)
    assert drivers["allowed_importers"][0] == "outbox.drivers"
    drivers["allowed_importers"] = drivers["allowed_importers"][1:]
    result = lint(contracts_file(tmp_path, [drivers]))
    assert result.returncode != 0, result.stdout
    assert "outbox.drivers.postgresql" in result.stdout


def test_only_the_drivers_contracts_importers_import_sqlalchemys_dialects() -> None:
    importers = importers_of("sqlalchemy.dialects")
    # The scan sees the drivers' own imports: it would see anyone else's.
    assert {"outbox.drivers.postgresql", "outbox.drivers.sqlite"} <= importers
    # And outbox.ddl, the declared schema's MySQL column types (LONGBLOB, LONGTEXT): the
    # schema is below the drivers, which import it, so they cannot hold its types.
    permitted = [*contract(DRIVERS)["allowed_importers"], "outbox.ddl"]
    assert sorted(m for m in importers if not allowed(m, permitted)) == []


PRODUCT = ("outbox", "relay", "receiver", "outbox_cli")
LONGEST = 400


def test_no_product_file_is_over_400_lines() -> None:
    # Small modules, each one concept: a file that grows past this is split by concept.
    lengths = {
        path.relative_to(ROOT).as_posix(): len(path.read_text().splitlines())
        for package in PRODUCT
        for path in (ROOT / package).rglob("*")
        if path.is_file() and path.suffix in (".py", ".html", ".js", ".css", ".sql")
    }
    assert len(lengths) > 100, "the product's files were not found"
    assert {path: n for path, n in lengths.items() if n > LONGEST} == {}
