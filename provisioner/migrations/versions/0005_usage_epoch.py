"""usage intervals: start and end as integer microseconds since 1970, for reports in SQL

Revision ID: 0005
Revises: 0004
"""

from datetime import UTC, datetime, timedelta

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
US = timedelta(microseconds=1)
# indexes that cover the report's queries (written out: a migration never imports the models)
INDEXES = {
    "ix_usage_machine_rate": ("machine_id", "kind", "currency", "rate", "start_us", "end_us"),
    "ix_usage_rate_start": ("currency", "rate", "start_us", "end_us", "kind", "machine_id"),
    "ix_usage_rate_end": ("currency", "rate", "end_us", "start_us", "kind", "machine_id"),
}


def _us(at: datetime | None) -> int | None:
    if at is None:
        return None
    return ((at if at.tzinfo else at.replace(tzinfo=UTC)) - EPOCH) // US


def upgrade() -> None:
    op.add_column("usage_intervals", sa.Column("start_us", sa.BigInteger))
    op.add_column("usage_intervals", sa.Column("end_us", sa.BigInteger))
    conn = op.get_bind()
    t = sa.table(
        "usage_intervals",
        sa.column("id", sa.Integer),
        sa.column("started_at", sa.DateTime(timezone=True)),
        sa.column("ended_at", sa.DateTime(timezone=True)),
        sa.column("start_us", sa.BigInteger),
        sa.column("end_us", sa.BigInteger),
    )
    # existing rows keep their data: the integer times computed from the stored ones (SQLite
    # keeps naive UTC text, PostgreSQL timestamptz), in batches
    rows = conn.execute(sa.select(t.c.id, t.c.started_at, t.c.ended_at)).all()
    update = (
        t.update()
        .where(t.c.id == sa.bindparam("b_id"))
        .values(start_us=sa.bindparam("b_start"), end_us=sa.bindparam("b_end"))
    )
    for i in range(0, len(rows), 10_000):
        conn.execute(
            update,
            [
                {"b_id": r.id, "b_start": _us(r.started_at), "b_end": _us(r.ended_at)}
                for r in rows[i : i + 10_000]
            ],
        )
    with op.batch_alter_table("usage_intervals") as b:
        b.alter_column("start_us", existing_type=sa.BigInteger, nullable=False)
    for name, cols in INDEXES.items():
        op.create_index(name, "usage_intervals", list(cols))


def downgrade() -> None:
    for name in INDEXES:
        op.drop_index(name, table_name="usage_intervals")
    with op.batch_alter_table("usage_intervals") as b:
        b.drop_column("end_us")
        b.drop_column("start_us")
