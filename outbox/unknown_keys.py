"""Unknown keys in configuration are refused, with the nearest known key suggested.

A typo must never leave a default silently in force: `concurency = 4` that ran with
one task at a time looked configured and was not.
"""

from __future__ import annotations

import difflib
from collections.abc import Collection, Iterable, Mapping

from outbox.errors import ConfigError


def did_you_mean(word: str, known: Iterable[str]) -> str | None:
    """The known word closest to `word`, if one is close enough to be the intended one."""
    close = difflib.get_close_matches(word, sorted(known), n=1, cutoff=0.6)
    return close[0] if close else None


def refuse_unknown(
    where: str,
    given: Iterable[str],
    known: Collection[str],
    renamed: Mapping[str, str] | None = None,
) -> None:
    """ConfigError naming the first unknown key of `given` (sorted), and what was meant."""
    renamed = renamed or {}
    for key in sorted(set(given) - set(known)):
        if key in renamed:
            raise ConfigError(f"{where}: `{key}` is now called `{renamed[key]}`")
        close = did_you_mean(key, known)
        if close:
            raise ConfigError(f"{where}: unknown key `{key}` (did you mean `{close}`?)")
        raise ConfigError(f"{where}: unknown key `{key}`; known: {', '.join(sorted(known))}")
