"""What a team member's PostgreSQL role may touch, granted per kind, and the database's own
answer to "may I act on these machines?" (migration 0015 holds the checks themselves).

Roles are cluster-wide while a state is one schema, so the migration grants nothing:
:func:`grant_member` grants one login role what its kind needs on the state's schema (an
admin's ``policy apply`` calls it for every member). Row-level security and triggers then
decide which rows: these privileges are only the outer fence — no DELETE of the ledger or
events for anyone, UPDATE of an interval's end only, of a token's revocation only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sqlalchemy import text

from provisioner.errors import UserError
from provisioner.schema import MemberKind

if TYPE_CHECKING:
    from provisioner.state import Database

#: what every kind reads: every table but tokens, which row-level security narrows to one's own
_ALL = "ALL TABLES IN SCHEMA {s}"

#: kind → (privilege, table) pairs beyond SELECT
_MEMBER = (
    ("INSERT, UPDATE", "machines"),
    ("INSERT, UPDATE", "volumes"),
    ("INSERT", "events"),
    ("INSERT", "usage_intervals"),
    ("UPDATE (ended_at, end_us)", "usage_intervals"),
    ("INSERT", "tokens"),
    ("UPDATE (revoked_at)", "tokens"),
    ("INSERT", "deliveries"),
    ("INSERT, UPDATE", "job_logs"),  # a job's output kept when it ends (0016)
    ("INSERT, UPDATE", "workdirs"),  # the workdir as `up` took it (0016)
)
_SCHEDULER = (
    *_MEMBER,
    ("UPDATE (detail)", "events"),
    ("UPDATE, DELETE", "deliveries"),
    *(
        ("INSERT, UPDATE, DELETE", t)
        for t in (
            "heartbeats",
            "signed_marks",
            "scheduler_leases",
            "endpoint_outages",
            "budget_notices",
            "team_keys",
        )
    ),
)
_ADMIN = (
    *_SCHEDULER,
    ("INSERT", "team_rules"),
    *(("INSERT, UPDATE, DELETE", t) for t in ("team_members", "team_grants", "state_meta")),
)
KINDS = {MemberKind.MEMBER: _MEMBER, MemberKind.SCHEDULER: _SCHEDULER, MemberKind.ADMIN: _ADMIN}


def _q(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def grant_statements(schema: str, role: str, kind: str = MemberKind.MEMBER) -> list[str]:
    """The GRANTs :func:`grant_member` runs (``kind``: member, scheduler or admin)."""
    if kind not in KINDS:
        raise ValueError(f"kind {kind!r}: one of {', '.join(KINDS)}")
    s, r = _q(schema), _q(role)
    out = [
        f"GRANT USAGE ON SCHEMA {s} TO {r}",
        f"GRANT SELECT ON {_ALL.format(s=s)} TO {r}",
        f"GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA {s} TO {r}",
    ]
    out += [f"GRANT {what} ON {s}.{_q(table)} TO {r}" for what, table in KINDS[MemberKind(kind)]]
    return out


def grant_member(conn: Any, role: str, kind: str = MemberKind.MEMBER) -> None:
    """Grant ``role`` what a ``kind`` needs on the schema of ``conn`` (its ``search_path``'s
    first: the state's), as the tables' owner or a superuser. ``conn``: a SQLAlchemy
    connection or a psycopg one. Idempotent; a role of another kind before keeps its other
    privileges (revoke them with :func:`revoke_member` first)."""
    schema = _scalar(conn, "SELECT current_schema()")
    for statement in grant_statements(str(schema), role, kind):
        _run(conn, statement)


def revoke_member(conn: Any, role: str) -> None:
    """Take back everything :func:`grant_member` granted ``role`` on the state's schema."""
    s, r = _q(str(_scalar(conn, "SELECT current_schema()"))), _q(role)
    _run(conn, f"REVOKE ALL ON ALL TABLES IN SCHEMA {s} FROM {r}")
    _run(conn, f"REVOKE ALL ON ALL SEQUENCES IN SCHEMA {s} FROM {r}")
    _run(conn, f"REVOKE ALL ON SCHEMA {s} FROM {r}")


def _scalar(conn: Any, sql: str) -> Any:
    if hasattr(conn, "exec_driver_sql"):
        return conn.execute(text(sql)).scalar()
    return conn.execute(sql).fetchone()[0]


def _run(conn: Any, sql: str) -> None:
    if hasattr(conn, "exec_driver_sql"):
        conn.exec_driver_sql(sql)
    else:
        conn.execute(sql)


def refused_machines(conn: Any, ids: list[str]) -> list[tuple[str, str, str]]:
    """(name, owner, project) of the machines ``ids`` the connected role may not act on, as
    the database decides (``prov_may_act``, the rule its row-level security applies): asked
    before a cloud is, so a refusal comes before anything is done, not after."""
    if not ids:
        return []
    rows = conn.execute(
        text(
            "SELECT name, owner, project FROM machines"
            " WHERE id = ANY(:ids) AND NOT prov_may_act(owner, project) ORDER BY name"
        ),
        {"ids": list(ids)},
    )
    return [(str(n), str(o), str(p)) for n, o, p in rows]


def require_may_act(db: Database, ids: list[str]) -> None:
    """Refuse (exit 2) before any cloud is asked when the database would refuse the caller's
    write of one of the machines ``ids`` (a volume's ledger row has its id) (PostgreSQL:
    :func:`refused_machines`; SQLite: one user's file, nothing to ask). The writes after the
    cloud acts are refused alike: this only makes the refusal come first."""
    if db.engine.dialect.name != "postgresql" or not ids:
        return
    with db.engine.connect() as conn:
        refused = refused_machines(conn, ids)
    if refused:
        name, owner, project = refused[0]
        raise UserError(
            f"the team's state refused: you may not act for {owner} on project {project} "
            f"({name}); the team's rules (team_grants) decide who may act for whom"
        )
