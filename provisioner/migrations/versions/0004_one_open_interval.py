"""one open usage interval per machine and kind

Revision ID: 0004
Revises: 0003
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Two concurrent `start`s could each open an interval (issue 14): a duplicate one counted
    # the same hours twice, so it is closed where it began (zero length) before the index.
    conn = op.get_bind()
    open_ = conn.execute(
        sa.text(
            "SELECT id, machine_id, kind FROM usage_intervals WHERE ended_at IS NULL"
            " ORDER BY started_at, id"
        )
    ).all()
    seen = set()
    for id_, machine_id, kind in open_:
        if (machine_id, kind) in seen:
            conn.execute(
                sa.text("UPDATE usage_intervals SET ended_at = started_at WHERE id = :id"),
                {"id": id_},
            )
        seen.add((machine_id, kind))
    op.create_index(
        "uq_usage_one_open",
        "usage_intervals",
        ["machine_id", "kind"],
        unique=True,
        sqlite_where=sa.text("ended_at IS NULL"),
        postgresql_where=sa.text("ended_at IS NULL"),
    )


def downgrade() -> None:
    op.drop_index("uq_usage_one_open", table_name="usage_intervals")
