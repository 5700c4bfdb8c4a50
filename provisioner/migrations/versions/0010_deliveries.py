"""deliveries: each notice to each notify channel (telegram, slack, webhook, email) and how it went

Revision ID: 0010
Revises: 0009
"""

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "deliveries",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("key", sa.String(255), nullable=False, unique=True),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("topic", sa.String(32), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("target", sa.String(255), nullable=False),
        sa.Column("channel", sa.JSON, nullable=False),
        sa.Column("subject", sa.Text, nullable=False),
        sa.Column("text", sa.Text, nullable=False),
        sa.Column("policy", sa.String(128)),
        sa.Column("machine", sa.String(128)),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("attempts", sa.Integer, nullable=False),
        sa.Column("next_at", sa.DateTime(timezone=True)),
        sa.Column("error", sa.Text),
        sa.Column("done_at", sa.DateTime(timezone=True)),
    )
    op.create_index("ix_deliveries_at", "deliveries", ["at"])
    op.create_index("ix_deliveries_status", "deliveries", ["status"])


def downgrade() -> None:
    op.drop_table("deliveries")
