"""`outbox db upgrade` and `outbox receiver upgrade`: apply the migrations, say what changed."""

from __future__ import annotations

from collections.abc import Sequence

from outbox import migrations
from outbox.redaction import redact


def upgrade(url: str, branches: Sequence[str]) -> tuple[list[str], list[str]]:
    """Upgrade each branch of the database at `url`; (the revisions after, a line per branch)."""
    before = migrations.heads_of(url)
    for branch in branches:
        migrations.upgrade_branch(url, branch)
    after = list(migrations.heads_of(url))
    return after, [f"{redact(url)}: {change(branch, before, after)}" for branch in branches]


def change(branch: str, before: Sequence[str], after: Sequence[str]) -> str:
    """What an upgrade did to `branch`: created it, upgraded it, or found it up to date."""
    old = migrations.branch_head(before, branch)
    new = migrations.branch_head(after, branch)
    if old is None:
        return f"created the {branch} schema at revision {new}"
    if old == new:
        return f"the {branch} schema is up to date at revision {new}"
    return f"upgraded the {branch} schema from revision {old} to {new}"
