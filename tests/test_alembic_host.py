"""A service with its own Alembic environment hosts our branches: docs/how-to/alembic.md, run.

Each test builds the service's Alembic project in tmp_path, with the env.py printed in
docs/how-to/alembic.md, and runs the real `alembic` command on a PostgreSQL database of its own.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import sqlalchemy as sa

import alembic
import outbox
import receiver
from outbox import TaskQueue
from outbox.migrations import required_head
from outbox.receiver_tables import metadata as receiver_metadata
from outbox.schema import metadata as outbox_metadata
from outbox_cli import main

pytestmark = pytest.mark.postgresql_only

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "docs" / "how-to" / "alembic.md"
OUR_TABLES = {*outbox_metadata.tables, *receiver_metadata.tables}
BOTH_HEADS = {required_head("outbox"), required_head("receiver")}
MODELS = """
import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase


class Base(DeclarativeBase):
    pass


orders = sa.Table("orders", Base.metadata, sa.Column("id", sa.Integer, primary_key=True))
"""
ORDERS = """
import sqlalchemy as sa
from alembic import op

revision = "h0001"
down_revision = None


def upgrade() -> None:
    op.create_table("orders", sa.Column("id", sa.Integer, primary_key=True))


def downgrade() -> None:
    op.drop_table("orders")
"""


def recipe(marker: str) -> str:
    """The Python block of docs/how-to/alembic.md that contains `marker`."""
    blocks = re.findall(r"```python\n(.*?)```", RECIPE.read_text(), flags=re.DOTALL)
    found = [block for block in blocks if marker in block]
    assert len(found) == 1, f"docs/how-to/alembic.md: expected one python block with {marker!r}"
    return str(found[0])


def without(text: str, *lines: str) -> str:
    """`text` without the lines containing each of `lines` (each must be there)."""
    for line in lines:
        assert line in text, line
        text = "\n".join(kept for kept in text.splitlines() if line not in kept) + "\n"
    return text


def env_py(*, ours: bool = True, filters: bool = True) -> str:
    """The documented env.py; without our upgrade calls or the autogenerate filters."""
    text = recipe("def run_migrations_online")
    if not ours:
        text = without(text, "outbox.upgrade(connection)", "receiver.upgrade(connection)")
    if not filters:
        text = without(text, "include_name=include_name", "include_object=include_object")
    return text


def service(root: Path, url: str, env: str, migrations: dict[str, str]) -> Path:
    """Write the service's Alembic project under `root`; return its alembic.ini."""
    scripts = root / "migrations"
    (scripts / "versions").mkdir(parents=True)
    (scripts / "env.py").write_text(env)
    template = Path(alembic.__file__).parent / "templates" / "generic" / "script.py.mako"
    shutil.copyfile(template, scripts / "script.py.mako")
    for name, text in migrations.items():
        (scripts / "versions" / name).write_text(text)
    (root / "myapp").mkdir()
    (root / "myapp" / "__init__.py").write_text("")
    (root / "myapp" / "models.py").write_text(MODELS)
    ini = root / "alembic.ini"
    ini.write_text(
        "[alembic]\n"
        "script_location = %(here)s/migrations\n"
        "path_separator = os\n"
        f"sqlalchemy.url = {url.replace('%', '%%')}\n"
    )
    return ini


def run_alembic(ini: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The real `alembic` command on the service's project, importing this checkout."""
    path = [str(ROOT), str(ini.parent), os.environ.get("PYTHONPATH", "")]
    return subprocess.run(
        [sys.executable, "-m", "alembic", "-c", str(ini), *args],
        cwd=ini.parent,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, path))},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def ok(result: subprocess.CompletedProcess[str]) -> None:
    """Assert an `alembic` run exited 0, showing its output if not."""
    assert result.returncode == 0, result.stdout + result.stderr


def database(url: str) -> tuple[set[str], dict[str, str], dict[str, str]]:
    """(tables, service version -> xmin, our version -> xmin): a rewritten row has a new xmin."""
    engine = outbox.create_engine(url)
    try:
        with engine.connect() as conn:
            tables = set(sa.inspect(conn).get_table_names())
            versions = []
            for table in ("alembic_version", "outbox_alembic_version"):
                rows = (
                    conn.execute(sa.text(f"SELECT version_num, xmin::text FROM {table}"))
                    if table in tables
                    else []
                )
                versions.append({row[0]: row[1] for row in rows})
        return tables, versions[0], versions[1]
    finally:
        engine.dispose()


def test_upgrade_heads_applies_ours_and_autogenerate_leaves_them_alone(
    tmp_path: Path, pg_blank_url: str
) -> None:
    ini = service(tmp_path / "app", pg_blank_url, env_py(), {"h0001_orders.py": ORDERS})
    ok(run_alembic(ini, "upgrade", "heads"))
    tables, host, ours = database(pg_blank_url)
    assert tables >= OUR_TABLES | {"orders"}
    assert set(host) == {"h0001"}
    assert set(ours) == BOTH_HEADS
    ok(run_alembic(ini, "upgrade", "heads"))
    assert database(pg_blank_url) == (tables, host, ours)  # no row of a version table rewritten

    ok(run_alembic(ini, "revision", "--autogenerate", "-m", "nothing", "--rev-id", "h0002"))
    (script,) = (ini.parent / "migrations" / "versions").glob("h0002_*.py")
    upgrade = script.read_text().split("def upgrade()", 1)[1].split("def downgrade()", 1)[0]
    assert "op." not in upgrade, upgrade  # nothing proposed at all: the service is up to date

    # The same service without the filters would drop every table of ours.
    bare = service(tmp_path / "bare", pg_blank_url, env_py(filters=False), {"h0001.py": ORDERS})
    ok(run_alembic(bare, "revision", "--autogenerate", "-m", "drops", "--rev-id", "h0002"))
    (script,) = (bare.parent / "migrations" / "versions").glob("h0002_*.py")
    upgrade = script.read_text().split("def upgrade()", 1)[1].split("def downgrade()", 1)[0]
    proposed = set(re.findall(r"op\.drop_table\('(\w+)'\)", upgrade))
    assert proposed == OUR_TABLES | {"outbox_alembic_version"}


def test_a_service_migration_applies_ours_and_alembic_carries_on(
    tmp_path: Path, pg_blank_url: str
) -> None:
    ours_first = recipe("outbox.upgrade(op.get_bind())")
    after = ORDERS.replace('"h0001"', '"h0002"').replace("None", '"3f1c0a9b7d21"')
    after = after.replace('"orders"', '"invoices"')
    migrations = {"h0001_orders.py": ours_first, "h0002_invoices.py": after}
    ini = service(tmp_path / "app", pg_blank_url, env_py(ours=False), migrations)
    ok(run_alembic(ini, "upgrade", "head"))
    tables, host, ours = database(pg_blank_url)
    assert tables >= (OUR_TABLES - set(receiver_metadata.tables)) | {"orders"}
    assert "invoices" in tables  # the next migration still had Alembic's `op`
    assert set(host) == {"h0002"}
    assert set(ours) == {required_head("outbox")}
    ok(run_alembic(ini, "upgrade", "head"))
    assert database(pg_blank_url) == (tables, host, ours)


def test_a_failure_after_ours_rolls_ours_back(tmp_path: Path, pg_blank_url: str) -> None:
    failing = without(recipe("outbox.upgrade(op.get_bind())"), "op.create_table(")
    failing = failing.replace(
        "def downgrade()",
        "    receiver.upgrade(op.get_bind())\n"
        '    raise RuntimeError("the service migration fails")\n\n\n'
        "def downgrade()",
    ).replace("import outbox\n", "import outbox\nimport receiver\n")
    ini = service(tmp_path / "app", pg_blank_url, env_py(ours=False), {"h0001.py": failing})
    result = run_alembic(ini, "upgrade", "head")
    assert result.returncode != 0
    assert "the service migration fails" in result.stderr
    assert database(pg_blank_url) == (set(), {}, {})  # one transaction: ours went with it


def test_standalone_and_async_urls_share_the_version_table_with_the_service(
    tmp_path: Path, pg_blank_url: str
) -> None:
    async_url = sa.make_url(pg_blank_url).set(drivername="postgresql+asyncpg")
    outbox.upgrade(async_url.render_as_string(hide_password=False))
    args = ["db", "upgrade", "--receiver", "--db", async_url.render_as_string(hide_password=False)]
    assert main(args) == 0
    before = database(pg_blank_url)
    assert set(before[2]) == BOTH_HEADS

    ini = service(tmp_path / "app", pg_blank_url, env_py(), {"h0001_orders.py": ORDERS})
    ok(run_alembic(ini, "upgrade", "heads"))
    tables, host, ours = database(pg_blank_url)
    assert ours == before[2]  # ours were at head: the service's run left them as they were
    assert set(host) == {"h0001"}
    outbox.upgrade(pg_blank_url)
    receiver.upgrade(pg_blank_url)
    assert database(pg_blank_url) == (tables, host, ours)
    TaskQueue(pg_blank_url).close()
