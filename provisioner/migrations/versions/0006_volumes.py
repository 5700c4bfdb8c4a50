"""volumes: network disks kept per project and name (each with its ledger row in machines)

Revision ID: 0006
Revises: 0005
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "volumes",
        sa.Column("id", sa.String(32), sa.ForeignKey("machines.id"), primary_key=True),
        sa.Column("project", sa.String(64), nullable=False),
        sa.Column("name", sa.String(64), nullable=False),
        sa.Column("owner", sa.String(128), nullable=False),
        sa.Column("cloud", sa.String(16), nullable=False),
        sa.Column("region", sa.String(64), nullable=False),
        sa.Column("zone", sa.String(64), nullable=False),
        sa.Column("size_gb", sa.Integer, nullable=False),
        sa.Column("token", sa.String(64), nullable=False),
        sa.Column("volume_id", sa.String(128)),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("attached_machine_id", sa.String(32), sa.ForeignKey("machines.id")),
        sa.Column("rate", sa.String(40)),
        sa.Column("currency", sa.String(3), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("deleted_at", sa.DateTime(timezone=True)),
    )
    op.create_index("ix_volumes_project", "volumes", ["project"])
    op.create_index("ix_volumes_status", "volumes", ["status"])
    op.create_index(
        "uq_volumes_live_name",
        "volumes",
        ["project", "name"],
        unique=True,
        sqlite_where=sa.text("status != 'deleted'"),
        postgresql_where=sa.text("status != 'deleted'"),
    )


def downgrade() -> None:
    op.drop_index("uq_volumes_live_name", table_name="volumes")
    op.drop_index("ix_volumes_status", table_name="volumes")
    op.drop_index("ix_volumes_project", table_name="volumes")
    op.drop_table("volumes")
