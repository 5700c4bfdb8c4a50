"""machines, events, usage intervals

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

LIVE = "status NOT IN ('terminated', 'failed')"


def upgrade() -> None:
    op.create_table(
        "machines",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("name", sa.String(64), nullable=False),
        sa.Column("project", sa.String(64), nullable=False, index=True),
        sa.Column("owner", sa.String(128), nullable=False, index=True),
        sa.Column("status", sa.String(16), nullable=False, index=True),
        sa.Column("spec", sa.JSON, nullable=False),
        sa.Column("spec_path", sa.Text),
        sa.Column("cloud", sa.String(16)),
        sa.Column("region", sa.String(64)),
        sa.Column("zone", sa.String(64)),
        sa.Column("instance_type", sa.String(64)),
        sa.Column("gpu", sa.String(16)),
        sa.Column("gpu_count", sa.Integer),
        sa.Column("market", sa.String(8)),
        sa.Column("instance_id", sa.String(128)),
        sa.Column("resource_name", sa.String(64)),
        sa.Column("rate", sa.String(40)),
        sa.Column("currency", sa.String(3)),
        sa.Column("disk_gb", sa.Integer),
        sa.Column("disk_rate", sa.String(40)),
        sa.Column("public_ip", sa.String(64)),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("launched_at", sa.DateTime(timezone=True)),
        sa.Column("terminated_at", sa.DateTime(timezone=True)),
    )
    op.create_index(
        "uq_machines_live_name", "machines", ["name"], unique=True,
        sqlite_where=sa.text(LIVE), postgresql_where=sa.text(LIVE),
    )
    op.create_table(
        "events",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("machine_id", sa.String(32), sa.ForeignKey("machines.id"), nullable=False, index=True),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False, index=True),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("reason", sa.String(64)),
        sa.Column("detail", sa.JSON, nullable=False),
    )
    op.create_table(
        "usage_intervals",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("machine_id", sa.String(32), sa.ForeignKey("machines.id"), nullable=False, index=True),
        sa.Column("kind", sa.String(8), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("ended_at", sa.DateTime(timezone=True)),
        sa.Column("rate", sa.String(40), nullable=False),
        sa.Column("currency", sa.String(3), nullable=False),
        sa.UniqueConstraint("machine_id", "kind", "started_at", name="uq_usage_machine_kind_start"),
    )
    op.create_index("ix_usage_period", "usage_intervals", ["started_at", "ended_at"])


def downgrade() -> None:
    op.drop_table("usage_intervals")
    op.drop_table("events")
    op.drop_index("uq_machines_live_name", table_name="machines")
    op.drop_table("machines")
