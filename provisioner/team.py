"""The team's rules in the team's state (PostgreSQL): its policies and member map, applied by an
admin (``provisioner policy apply``), versioned with who applied what (``team_rules``), and the
member map and ``act_as`` grants derived from the newest version (``team_members``,
``team_grants``: what the database's own checks read).

Once a version exists, it is the rules in force for everyone on that state:

- the policies are the team's; a member's own policy files (``policies:`` in their settings)
  only add restrictions: their ``act_as`` and ``notify`` are dropped, each applies only to the
  member's own machines (its owners become the member), and one named like a team policy is
  dropped when the same and renamed ``<name> (local)`` when not (:func:`combine`);
- who a database role is comes from the member map, not from the member's ``identity``
  settings; a role not in it may read, and the database refuses it every write.

Before the first version, and always on SQLite (one user's state file), the policy files and
``identity`` settings are the rules, as they always were.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import sys
from dataclasses import dataclass, field
from datetime import datetime
from fnmatch import fnmatchcase
from typing import Any

from sqlalchemy import delete, func, select, text

from policies import loader
from policies.schema import AppliesTo, Policy
from provisioner import identity
from provisioner.errors import UserError
from provisioner.fleet import NOT_APPLIED
from provisioner.models import TeamGrant, TeamMember, TeamRules
from provisioner.schema import MemberKind
from provisioner.settings import Settings
from provisioner.state import Database

KINDS = tuple(MemberKind)
SQLITE = (
    "SQLite: one user's state — the policies stay in your files (settings policies:); team "
    "rules are for a team's PostgreSQL state"
)
LOCAL_MARK = " (local)"


@dataclass(frozen=True)
class Member:
    email: str
    kind: str


@dataclass(frozen=True)
class Rules:
    """One version of the team's rules, read from the state."""

    version: int
    digest: str
    applied_at: datetime
    applied_by: str
    role: str
    note: str | None
    document: dict[str, Any]
    policies: list[Policy] = field(default_factory=list)
    in_force: dict[str, Member] | None = None  # team_members, read with the newest version

    @property
    def members(self) -> dict[str, Member]:
        """The member map: the rows of ``team_members`` for the rules in force (what the
        database's own checks read), the document's for an older version."""
        if self.in_force is not None:
            return self.in_force
        return {r: Member(m["email"], m["kind"]) for r, m in self.document["members"].items()}

    @property
    def domain(self) -> str:
        return str(self.document["domain"])

    def email_of(self, name: str) -> str:
        """The e-mail of a role (or a proxy's user name): the member map's, else
        ``<name>@<domain>`` of the rules."""
        m = self.members.get(name)
        return m.email if m else f"{name}@{self.domain}"


def team_state(db: Database) -> bool:
    return db.engine.dialect.name == "postgresql"


# --- the document ---------------------------------------------------------------------------


def document(settings: Settings) -> dict[str, Any]:
    """The rules the admin's files say: every policy of ``settings.policies`` (checked as any
    command checks them: every problem at once, or nothing) and the member map of
    ``identity.members``, ``identity.admins`` and ``identity.scheduler``."""
    policies = loader.load(settings.policies) if settings.policies else []
    ident = settings.identity
    members: dict[str, dict[str, str]] = {}
    roles = [*ident.members, *ident.admins, *([ident.scheduler] if ident.scheduler else [])]
    for role in roles:
        kind = (
            MemberKind.ADMIN
            if role in ident.admins
            else (MemberKind.SCHEDULER if role == ident.scheduler else MemberKind.MEMBER)
        )
        members[role] = {"email": identity.email_of(settings, role), "kind": kind}
    return {
        "domain": ident.domain,
        "members": members,
        "policies": sorted(
            (p.model_dump(mode="json", exclude_defaults=True) for p in policies),
            key=lambda p: p["name"],
        ),
    }


def canonical(doc: dict[str, Any]) -> str:
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def digest(doc: dict[str, Any]) -> str:
    return hashlib.sha256(canonical(doc).encode()).hexdigest()


def grant_rows(policies: list[Policy]) -> list[tuple[str, str, str]]:
    """``act_as`` flattened: one (actor glob, owner glob, project glob) per grant and project
    glob of the policy's scope. A scope with owner globs narrows the grant's: a ``*`` on either
    side takes the other's glob, a plain address takes part when the other glob matches it;
    two real globs (``a*`` and ``*b``) cannot be written as one, and are refused."""
    rows: list[tuple[str, str, str]] = []
    for p in policies:
        for actor_glob, owner_globs in p.act_as.items():
            for scoped in p.applies_to.owners:
                for o in owner_globs:
                    owner = _both(p.name, scoped, o)
                    rows.extend((actor_glob, owner, pr) for pr in p.applies_to.projects if owner)
    return sorted(set(rows))


def _both(policy: str, scope: str, grant: str) -> str | None:
    """The one glob matching what both ``scope`` and ``grant`` match; None: nothing."""
    plain = [g for g in (scope, grant) if not any(c in g for c in "*?[")]
    if scope == "*" or scope == grant:
        return grant
    if grant == "*":
        return scope
    if plain:
        other = grant if plain[0] == scope else scope
        return plain[0] if fnmatchcase(plain[0], other) else None
    raise UserError(
        f"policy {policy}: its act_as owner {grant!r} and its applies_to owner {scope!r} cannot "
        "be one glob for the database's checks; write one of them as '*' or as an address"
    )


# --- reading the state ----------------------------------------------------------------------

_cache: dict[str, Rules] = {}  # database URL → the newest rules read (re-read when newer)


def newest_version(db: Database) -> int | None:
    """The newest version's number (one cheap query); None before the first apply."""
    with db.session() as s:
        return s.scalar(select(func.max(TeamRules.version)))


def newest(db: Database, version: int | None = None) -> Rules | None:
    """The rules in force (or ``version``); None before the first apply and on SQLite."""
    if not team_state(db):
        return None
    asked = version
    if version is None:
        version = newest_version(db)
        if version is None:
            return None
    hit = _cache.get(db.url)
    if hit is not None and hit.version == version:
        return hit
    with db.session() as s:
        row = s.get(TeamRules, version)
        rows = s.scalars(select(TeamMember)).all() if asked is None else []
    if row is None:
        raise UserError(f"no version {version} of the team's rules (see provisioner policy log)")
    doc = json.loads(row.document)
    rules = Rules(
        row.version,
        row.digest,
        row.applied_at,
        row.applied_by,
        row.role,
        row.note,
        doc,
        [Policy.model_validate(p) for p in doc["policies"]],
        {m.role: Member(m.email, m.kind) for m in rows} if asked is None else None,
    )
    if asked is None:
        _cache[db.url] = rules
    return rules


def hint(db: Database) -> str | None:
    """What ``status`` says on a team's state before its first rules."""
    return NOT_APPLIED if team_state(db) and newest_version(db) is None else None


def history(db: Database) -> list[TeamRules]:
    with db.session() as s:
        return list(s.scalars(select(TeamRules).order_by(TeamRules.version)))


def privileged(db: Database) -> bool:
    """Whether this connection's role owns the team's tables (the one who migrated) or is a
    superuser: the database lets it do anything, so it may apply rules."""
    q = text(
        "SELECT r.rolsuper OR pg_has_role(current_user, c.relowner, 'MEMBER') FROM pg_roles r,"
        " pg_class c WHERE r.rolname = current_user AND c.oid = to_regclass('team_rules')"
    )
    with db.session() as s:
        return bool(s.scalar(q))


def names_others(db: Database) -> bool:
    """Whether this process may believe an authenticating proxy's user names (a dashboard's
    ``identity.trusted_proxies``): on SQLite and before a team's first rules, as settings say;
    after, only as the scheduler's role or an admin's, or the state's owner: a member's own
    dashboard with a proxy of their choosing names nobody."""
    rules = newest(db)
    if rules is None:
        return True
    mine = rules.members.get(identity.database_role(db))
    return (
        mine is not None and mine.kind in (MemberKind.ADMIN, MemberKind.SCHEDULER)
    ) or privileged(db)


def not_member(role: str) -> str:
    return f"{role} is not a member of this team's state; an admin adds you with policy apply"


# --- applying -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Applied:
    version: int
    changed: bool
    grants: int = 0
    members: int = 0
    missing: tuple[str, ...] = ()  # member roles the server has no such login role for


def apply(db: Database, settings: Settings, now: datetime, actor: str, note: str | None) -> Applied:
    """A new version of the team's rules from the admin's files, with the member map and
    grants derived from it, in one transaction; the same document again: no new version."""
    if not team_state(db):
        raise UserError(SQLITE)
    doc = document(settings)
    role = identity.database_role(db)
    _may_apply(db, role, doc)
    policies = [Policy.model_validate(p) for p in doc["policies"]]
    grants = grant_rows(policies)
    text_, sha = canonical(doc), digest(doc)
    with db.lock("team-rules"), db.session() as s:
        last = s.scalars(select(TeamRules).order_by(TeamRules.version.desc()).limit(1)).first()
        if last is not None and last.digest == sha:
            return Applied(last.version, False)
        row = TeamRules(
            applied_at=now, applied_by=actor, role=role, digest=sha, document=text_, note=note
        )
        s.add(row)
        s.flush()
        # in an order the database's own checks (0015) pass at every statement: the admin who
        # applies stays an admin (_may_apply) until their row is rewritten, last
        for a, o, p in grants:
            s.add(TeamGrant(version=row.version, actor_glob=a, owner_glob=o, project_glob=p))
        s.flush()
        s.execute(delete(TeamGrant).where(TeamGrant.version != row.version))
        old = {m.role: m for m in s.scalars(select(TeamMember))}
        s.execute(delete(TeamMember).where(TeamMember.role.not_in(list(doc["members"]))))
        for r, m in sorted(doc["members"].items(), key=lambda rm: rm[0] == role):
            if r in old:
                old[r].email, old[r].kind, old[r].version = m["email"], m["kind"], row.version
            else:
                s.add(TeamMember(role=r, email=m["email"], kind=m["kind"], version=row.version))
            s.flush()
        version = row.version
    missing = _grant_privileges(db, doc["members"], set(old) - set(doc["members"]))
    return Applied(version, True, len(grants), len(doc["members"]), missing)


def _grant_privileges(db: Database, members: dict[str, Any], removed: set[str]) -> tuple[str, ...]:
    """What each member's kind needs on the state's tables (:func:`team_sql.grant_member`),
    granted by the tables' owner or a superuser (an admin member cannot grant: the owner runs
    ``policy apply`` again); a removed member's taken back. The roles the server has none of
    yet: returned, to be made (``CREATE ROLE … LOGIN``) and applied again."""
    from provisioner import team_sql

    if not privileged(db):
        return ()
    missing = []
    with db.engine.begin() as conn:
        known = {str(r) for r in conn.execute(text("SELECT rolname FROM pg_roles")).scalars()}
        for r in sorted(removed & known):
            team_sql.revoke_member(conn, r)
        for r, m in sorted(members.items()):
            if r not in known:
                missing.append(r)
                continue
            team_sql.revoke_member(conn, r)  # a kind changed: nothing of the old one kept
            team_sql.grant_member(conn, r, m["kind"])
    return tuple(missing)


def _may_apply(db: Database, role: str, doc: dict[str, Any]) -> None:
    """Only an admin applies: the owner of the team's tables or a superuser, or an admin of
    the rules in force; nor may an admin apply rules that leave them out of the admins."""
    rules = newest(db)
    if privileged(db):
        return
    if rules is None:
        raise UserError(
            f"{role} may not apply the team's first rules: the role that owns the state's "
            "tables (who migrated it) does, naming the admins in identity.admins"
        )
    mine = rules.members.get(role)
    if mine is None or mine.kind != MemberKind.ADMIN:
        raise UserError(
            f"{role} is not an admin of this team's rules (version {rules.version}): an admin "
            "applies them"
        )
    if doc["members"].get(role, {}).get("kind") != MemberKind.ADMIN:
        raise UserError(
            f"these rules leave you ({role}) out of identity.admins: you could not apply the "
            "next ones; add yourself, or let the state's owner apply them"
        )


# --- diff -----------------------------------------------------------------------------------


def diff(settings: Settings, rules: Rules | None) -> str:
    """The admin's files against the rules in force: a unified diff of the canonical
    documents, member map first, then policy by policy; "" when they are the same."""
    empty: dict[str, Any] = {"domain": "localhost", "members": {}, "policies": []}
    theirs = rules.document if rules else empty
    mine = document(settings)
    if rules is not None and digest(mine) == rules.digest:
        return ""
    label = f"team rules (version {rules.version})" if rules else "team rules (none)"
    out: list[str] = []
    head = {k: theirs[k] for k in ("domain", "members")}
    out += _udiff(head, {k: mine[k] for k in ("domain", "members")}, label, "members")
    old = {p["name"]: p for p in theirs["policies"]}
    new = {p["name"]: p for p in mine["policies"]}
    for name in sorted(old.keys() | new.keys()):
        out += _udiff(old.get(name), new.get(name), label, f"policy {name}")
    return "".join(out)


def _udiff(old: Any, new: Any, label: str, what: str) -> list[str]:
    def lines(x: Any) -> list[str]:
        shown = json.dumps(x, indent=2, sort_keys=True) + "\n"
        return [] if x is None else shown.splitlines(True)

    return list(
        difflib.unified_diff(
            lines(old), lines(new), f"{label}: {what}", f"your files: {what}", lineterm="\n"
        )
    )


# --- the rules in force, with a member's own files ------------------------------------------


def combine(rules: Rules, local: list[Policy], actor: str) -> list[Policy]:
    """The team's policies, then the member's own (``local``) as narrowing ones: without
    ``act_as`` or ``notify``, applying to the member's own machines only, and never in a team
    policy's place (the same as the team's: dropped; else renamed ``<name> (local)``)."""
    team = {p.name: p for p in rules.policies}
    out = list(rules.policies)
    dropped: set[str] = set()
    for p in local:
        if team.get(p.name) == p:
            continue
        dropped |= {f for f in ("act_as", "notify") if getattr(p, f)}
        owners = [actor] if any(fnmatchcase(actor, o) for o in p.applies_to.owners) else []
        if not owners:
            continue  # it applies to none of the member's machines
        name = p.name + LOCAL_MARK if p.name in team else p.name
        scope = AppliesTo(projects=p.applies_to.projects, owners=owners)
        out.append(
            p.model_copy(update={"name": name, "applies_to": scope, "act_as": {}, "notify": []})
        )
    why = {"act_as": "grants come from", "notify": "notices go where"}
    for f in sorted(dropped):
        print(
            f"local {f} ignored: {why[f]} the team's rules (version {rules.version})",
            file=sys.stderr,
        )
    return out
