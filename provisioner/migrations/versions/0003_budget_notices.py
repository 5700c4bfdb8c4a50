"""budget notices: alerts, exhaustion and scheduled reports, each once per policy and period

Revision ID: 0003
Revises: 0002
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "budget_notices",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("policy", sa.String(128), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("period_start", sa.DateTime(timezone=True), nullable=False),
        sa.Column("mark", sa.String(40), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("detail", sa.JSON, nullable=False),
        sa.UniqueConstraint("policy", "kind", "period_start", "mark", name="uq_budget_notice"),
    )
    # the savings and idle-waste queries look up events by reason
    op.create_index("ix_events_reason_at", "events", ["reason", "at"])


def downgrade() -> None:
    op.drop_index("ix_events_reason_at", table_name="events")
    op.drop_table("budget_notices")
