"""The documentation agrees with the code: generated reference pages, excerpts, config keys.

The site itself is built with `mkdocs build --strict` in `make docs`, which fails on a
broken link inside docs/; the README's links are checked here, since it lives outside.
"""

from __future__ import annotations

import re
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

from outbox_cli import OPTIONS
from relay.config import DESTINATION_KEYS
from tools import docs_reference

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted((ROOT / "docs").rglob("*.md"))
EXCERPT = re.compile(r"^From `([^`]+)`:\n\n```python\n(.*?)^```", re.M | re.S)
TOML = re.compile(r"^```toml\n(.*?)^```", re.M | re.S)
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


@pytest.mark.skipif(
    sys.version_info >= (3, 13), reason="argparse formats --help differently from 3.13 on"
)
@pytest.mark.parametrize("name", sorted(docs_reference.PAGES))
def test_reference_pages_are_current(name: str) -> None:
    page = docs_reference.REFERENCE / name
    assert page.read_text(encoding="utf-8") == docs_reference.PAGES[name](), (
        f"{page.relative_to(ROOT)} is out of date: run {docs_reference.REGENERATE}"
    )


def test_every_destination_key_is_described() -> None:
    assert set(DESTINATION_KEYS) == set(docs_reference.DESTINATION_HELP)


def test_the_config_page_shows_the_real_defaults() -> None:
    page = (docs_reference.REFERENCE / "config.md").read_text(encoding="utf-8")
    # The Relay's own defaults, which its flags leave to the Relay: 3 attempts, 100 a batch.
    assert "| `--max-attempts` | `OUTBOX_RELAY_MAX_ATTEMPTS` |" in page
    assert re.search(r"`relay\.max_attempts` \| [^|]+ \| `3` \|", page)
    assert re.search(r"`relay\.batch` \| [^|]+ \| `100` \|", page)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_excerpts_are_copied_from_their_file(page: Path) -> None:
    for source, code in EXCERPT.findall(page.read_text(encoding="utf-8")):
        text = (ROOT / source).read_text(encoding="utf-8")
        dedented = {textwrap.dedent(text), text}
        lines = code.strip("\n").splitlines()
        found = any(
            "\n".join(lines) in textwrap.dedent(candidate)
            or all(line.strip() in candidate for line in lines)
            for candidate in dedented
        )
        assert found, f"{page.name}: the excerpt from {source} is not in it any more"


def _known_keys() -> dict[str, set[str]]:
    """Each config file table and the keys the commands read from it."""
    return {
        command: {option.key.partition(".")[2] for option in options}
        for command, options in OPTIONS.items()
    }


@pytest.mark.parametrize(
    "page", [ROOT / "README.md", *PAGES], ids=lambda p: str(p.relative_to(ROOT))
)
def test_config_examples_use_known_keys(page: Path) -> None:
    known = _known_keys()
    for block in TOML.findall(page.read_text(encoding="utf-8")):
        document = tomllib.loads(block)
        for table, values in document.items():
            if table == "db":
                continue
            if table == "destinations":
                for name, keys in values.items():
                    unknown = set(keys) - set(DESTINATION_KEYS)
                    assert not unknown, f"{page.name}: destinations.{name}: {unknown}"
                continue
            assert table in known, f"{page.name}: unknown table [{table}]"
            unknown = set(values) - known[table]
            assert not unknown, f"{page.name}: [{table}] {unknown}"


def test_readme_links_lead_somewhere() -> None:
    for target in LINK.findall((ROOT / "README.md").read_text(encoding="utf-8")):
        if "://" in target:
            continue
        assert (ROOT / target).exists(), f"README.md links to {target}, which does not exist"
