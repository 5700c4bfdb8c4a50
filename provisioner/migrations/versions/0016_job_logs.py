"""job logs and workdirs: each job's output kept with the state when it ends (its last MiB,
one row per attempt), and the workdir as ``up`` took it (a gzipped tar), so a relaunch restores
it and ``logs`` reads a job whose machine is stopped or gone

Revision ID: 0016
Revises: 0014 (re-chained after 0015 when merged)
"""

import sqlalchemy as sa
from alembic import op


revision = "0016"
down_revision = "0015"
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


    _guard()


def _guard() -> None:
    """On a team's PostgreSQL state (0015's checks): any member reads the kept logs and
    workdirs; writes only of a machine the writer may act on (``prov_may_act_on``); none
    deletes them but an admin."""
    conn = op.get_bind()
    if conn.dialect.name != "postgresql":
        return
    s = '"' + str(conn.exec_driver_sql("SELECT current_schema()").scalar()) + '"'
    member = f"(SELECT {s}.prov_kind()) IS NOT NULL"
    admin = f"(SELECT {s}.prov_is_admin())"
    on_machine = f"{s}.prov_may_act_on(machine_id)"
    for t in ("job_logs", "workdirs"):
        for statement in (
            f"ALTER TABLE {s}.{t} ENABLE ROW LEVEL SECURITY",
            f"CREATE POLICY read ON {s}.{t} FOR SELECT USING ({member})",
            f"CREATE POLICY write ON {s}.{t} FOR INSERT WITH CHECK ({on_machine})",
            f"CREATE POLICY change ON {s}.{t} FOR UPDATE USING ({member}) WITH CHECK ({on_machine})",
            f"CREATE POLICY remove ON {s}.{t} FOR DELETE USING ({admin})",
        ):
            conn.exec_driver_sql(statement)


def downgrade() -> None:
    op.drop_table("workdirs")
    op.drop_index("ix_job_logs_machine_id", table_name="job_logs")
    op.drop_table("job_logs")
