"""autostop: a machine's own autostop duration, and the SSH sessions each heartbeat saw

Revision ID: 0007
Revises: 0006
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("machines", sa.Column("autostop_seconds", sa.Integer))
    op.add_column("heartbeats", sa.Column("ssh_sessions", sa.Integer))


def downgrade() -> None:
    with op.batch_alter_table("heartbeats") as batch:
        batch.drop_column("ssh_sessions")
    with op.batch_alter_table("machines") as batch:
        batch.drop_column("autostop_seconds")
