"""team rules: the team's policies and member map, applied by an admin to the shared state,
versioned with who applied what (``team_rules``); the current member map (``team_members``)
and ``act_as`` grants (``team_grants``) derived from the newest version, for the database's
own checks (row-level security on PostgreSQL, 0015); ``state_meta``: facts about the
state set when it is made (``clock``: ``simulated`` for a state made on a shifted clock)

Revision ID: 0014
Revises: 0013
"""

import sqlalchemy as sa
from alembic import op


revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "team_rules",
        sa.Column("version", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("applied_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("applied_by", sa.String(128), nullable=False),  # the actor's e-mail
        sa.Column("role", sa.String(128), nullable=False),  # database role / OS user
        sa.Column("digest", sa.String(64), nullable=False),  # sha256 of document
        sa.Column("document", sa.Text, nullable=False),  # canonical JSON of the rules
        sa.Column("note", sa.Text),
    )
    op.create_table(
        "team_members",
        sa.Column("role", sa.String(128), primary_key=True),  # database role
        sa.Column("email", sa.String(254), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),  # MemberKind: member/admin/scheduler
        sa.Column("version", sa.Integer, nullable=False),  # team_rules.version that set it
    )
    op.create_table(
        "team_grants",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("version", sa.Integer, nullable=False),
        sa.Column("actor_glob", sa.String(254), nullable=False),  # fnmatch glob of an e-mail
        sa.Column("owner_glob", sa.String(254), nullable=False),
        sa.Column("project_glob", sa.String(254), nullable=False),  # '*' when unscoped
    )


    op.create_table(  # facts about the state itself, set when it is made (e.g. its clock)
        "state_meta",
        sa.Column("key", sa.String(64), primary_key=True),
        sa.Column("value", sa.Text, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("state_meta")
    op.drop_table("team_grants")
    op.drop_table("team_members")
    op.drop_table("team_rules")
