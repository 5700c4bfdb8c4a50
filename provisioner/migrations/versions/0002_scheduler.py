"""scheduler: agent token and keep-until on machines, heartbeats, leader leases

Revision ID: 0002
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # plain ALTER TABLE ADD COLUMN: a batch copy would risk machines' partial unique index
    op.add_column("machines", sa.Column("agent_token_hash", sa.String(64)))
    op.add_column("machines", sa.Column("kept_until", sa.DateTime(timezone=True)))
    op.create_index("ix_machines_agent_token_hash", "machines", ["agent_token_hash"], unique=True)
    op.create_table(
        "heartbeats",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("machine_id", sa.String(32), sa.ForeignKey("machines.id"), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("gpus", sa.JSON, nullable=False),
        sa.Column("max_util", sa.Float),  # busiest GPU, percent; NULL: the agent saw no GPU
    )
    op.create_index("ix_heartbeats_machine_at", "heartbeats", ["machine_id", "at"])
    op.create_index("ix_heartbeats_at", "heartbeats", ["at"])
    op.create_table(
        "scheduler_leases",
        sa.Column("name", sa.String(32), primary_key=True),
        sa.Column("holder", sa.String(128), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("scheduler_leases")
    op.drop_table("heartbeats")
    op.drop_index("ix_machines_agent_token_hash", table_name="machines")
    op.drop_column("machines", "kept_until")
    op.drop_column("machines", "agent_token_hash")
