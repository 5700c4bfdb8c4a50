"""the pull: the team's pull key (its public half, published for every `up`), and heartbeats
marked pulled (read over SSH from the machine's agent) rather than posted to the endpoint

Revision ID: 0013
Revises: 0012
"""

import sqlalchemy as sa
from alembic import op


revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "team_keys",
        sa.Column("name", sa.String(32), primary_key=True),
        sa.Column("public_key", sa.Text, nullable=False),
        sa.Column("fingerprint", sa.String(64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("created_by", sa.String(128), nullable=False),
    )
    op.add_column("heartbeats", sa.Column("pulled", sa.Boolean))


def downgrade() -> None:
    with op.batch_alter_table("heartbeats") as batch:
        batch.drop_column("pulled")
    op.drop_table("team_keys")
