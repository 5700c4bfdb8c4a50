"""job logs and workdirs: each job's output kept with the state when it ends (its last MiB,
one row per attempt), and the workdir as ``up`` took it (a gzipped tar), so a relaunch restores
it and ``logs`` reads a job whose machine is stopped or gone

Revision ID: 0016
Revises: 0014 (re-chained after 0015 when merged)
"""

import sqlalchemy as sa
from alembic import op


revision = "0016"
down_revision = "0014"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "job_logs",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("machine_id", sa.String(64), nullable=False),
        sa.Column("job", sa.String(64), nullable=False),
        sa.Column("attempt", sa.Integer, nullable=False),
        sa.Column("stage", sa.String(16), nullable=False),  # run | setup
        sa.Column("exit_code", sa.Integer),
        sa.Column("reason", sa.String(32), nullable=False),
        sa.Column("ended_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("size", sa.BigInteger, nullable=False),
        sa.Column("text", sa.LargeBinary, nullable=False),
        sa.Column("truncated", sa.Boolean, nullable=False),
    )
    op.create_index("ix_job_logs_machine_id", "job_logs", ["machine_id"])
    op.create_table(
        "workdirs",
        sa.Column("machine_id", sa.String(64), primary_key=True),
        sa.Column("taken_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("source", sa.Text, nullable=False),
        sa.Column("files", sa.Integer, nullable=False),
        sa.Column("archive", sa.LargeBinary, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("workdirs")
    op.drop_index("ix_job_logs_machine_id", table_name="job_logs")
    op.drop_table("job_logs")
