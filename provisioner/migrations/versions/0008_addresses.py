"""pieces: a machine's public IPv4 address priced in the ledger (rate fixed at launch)

Revision ID: 0008
Revises: 0007
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("machines", sa.Column("address_rate", sa.String(40)))
    op.add_column("machines", sa.Column("address_billed", sa.String(8)))


def downgrade() -> None:
    with op.batch_alter_table("machines") as batch:
        batch.drop_column("address_billed")
        batch.drop_column("address_rate")
