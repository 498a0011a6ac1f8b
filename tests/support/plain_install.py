"""An install without extras, simulated in a child process: every module that only an extra
(or the `dev` and `bench` tools) brings is unimportable there.

What is blocked is computed, not listed: the distributions outside the closure of the
package's own requirements (extras off) are the ones a plain `pip install outbox-relay`
lacks, so a new import of anything optional shows up here without this file changing.
"""

from __future__ import annotations

import os
import re
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

PACKAGE = "outbox-relay"
BLOCKER = Path(__file__).resolve().parent / "without_extras"


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def base_distributions() -> set[str]:
    """The distributions a plain install of the package brings, itself included (normalized)."""
    wanted: list[tuple[str, str]] = [(PACKAGE, "")]
    seen: set[tuple[str, str]] = set()
    while wanted:
        name, extra = wanted.pop()
        if (name, extra) in seen:
            continue
        seen.add((name, extra))
        try:
            requires = metadata.distribution(name).requires or []
        except metadata.PackageNotFoundError:
            continue  # excluded by a marker on this platform, so not installed
        for text in requires:
            requirement = Requirement(text)
            marker = requirement.marker
            if marker is not None and not marker.evaluate({"extra": extra}):
                continue
            wanted.append((_normal(requirement.name), ""))
            wanted.extend((_normal(requirement.name), e) for e in requirement.extras)
    return {name for name, _ in seen}


def blocked_modules() -> list[str]:
    """Top-level modules installed here that a plain install would not have."""
    base = base_distributions()
    return sorted(
        module
        for module, distributions in metadata.packages_distributions().items()
        if not any(_normal(d) in base for d in distributions)
    )


def plain_install_variables() -> dict[str, str]:
    """The environment variables that make a child process run as a plain install."""
    path = os.pathsep.join(filter(None, [str(BLOCKER), os.environ.get("PYTHONPATH")]))
    return {"PYTHONPATH": path, "WITHOUT_EXTRAS_BLOCKED": ",".join(blocked_modules())}
