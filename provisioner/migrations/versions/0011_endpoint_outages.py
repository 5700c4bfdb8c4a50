"""endpoint outages: when the scheduler's heartbeat endpoint refused connections or was not
running, so silence then is never read as idleness

Revision ID: 0011
Revises: 0010
"""

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "endpoint_outages",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("ended_at", sa.DateTime(timezone=True)),
        sa.Column("reason", sa.String(32), nullable=False),
        sa.Column("holder", sa.String(128), nullable=False),
        sa.Column("refused", sa.Integer, nullable=False, server_default="0"),
    )
    op.create_index("ix_endpoint_outages_ended_at", "endpoint_outages", ["ended_at"])


def downgrade() -> None:
    op.drop_index("ix_endpoint_outages_ended_at", "endpoint_outages")
    op.drop_table("endpoint_outages")
