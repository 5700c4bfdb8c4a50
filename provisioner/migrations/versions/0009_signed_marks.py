"""signed_marks: the newest signed time per agent route and machine, so a replayed heartbeat
or notice is refused across scheduler restarts (it was kept in memory only)

Revision ID: 0009
Revises: 0008
"""

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "signed_marks",
        sa.Column("route", sa.String(32), primary_key=True),
        sa.Column("machine_id", sa.String(32), primary_key=True),
        sa.Column("at_ms", sa.BigInteger, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("signed_marks")
