"""the database's own checks (PostgreSQL only; on SQLite, one user's file, nothing): row-level
security, triggers and functions that refuse a member connected with ``psql`` what the CLI
refuses them — launching as someone else, changing someone else's machine, raising a cap,
granting themselves ``act_as``, creating another member's token, rewriting the ledger, writing
on a shifted clock.

Who is who comes from the team's tables (0014), which only an admin writes:

- ``prov_me()``: the caller's e-mail (``team_members.email`` of ``current_user``), NULL for a
  role not in the map (it may then read and write nothing under row-level security);
- ``prov_kind()``: ``member`` / ``admin`` / ``scheduler`` / NULL;
- ``prov_is_owner()``: the role that ran this migration (the tables' owner) or a superuser:
  PostgreSQL's row-level security does not apply to it, nor do these triggers;
- ``prov_is_admin()``: the owner, or a role of kind ``admin``;
- ``prov_may_act(owner, project)``: the caller is the owner, an admin or the scheduler (which
  also serves the dashboard, acting for the user signed in), or a ``team_grants`` row (the
  grants in force: the table holds the newest version's) matches e-mail, owner and project as
  fnmatch globs (``prov_glob_regex`` turns one into an anchored POSIX regex, as Python's
  ``fnmatch.translate``).

The functions are SECURITY INVOKER (``current_user`` inside them is the caller, also after
``SET ROLE``), with a fixed ``search_path`` and every table schema-qualified: a member has no
CREATE on the schema and cannot shadow them. Every member may read the team tables.

Row-level security decides which rows a role sees and may write; a BEFORE trigger refuses
an UPDATE of a row the caller may not act on by its *old* owner (a policy's USING clause
would skip the row silently — UPDATE 0 — and the CLI could not say why). Every refusal is
SQLSTATE 42501 (insufficient_privilege) with a message that starts "not allowed:", which the
CLI shows as one line, exit 2 (:func:`provisioner.errors.state_refusal`).

Privileges are not granted here: roles are cluster-wide and a state is one schema;
:func:`provisioner.team_sql.grant_member` grants a member's role what its kind needs (no
DELETE on the ledger or events, UPDATE of an interval's end only, of a token's revocation
only).

The clock: unless ``state_meta`` says ``clock = simulated``, a non-owner's row is refused
when one of its instants lies more than 10 minutes after the server's ``now()``, a new
machine's or token's ``created_at`` more than 10 minutes from it, or an event's or interval's
instant more than 10 minutes before its machine's ``created_at``. Not "within 10 minutes of
now" for every instant: the product legitimately writes past instants (a reconcile closes a
preempted machine's interval when the cloud says it stopped, hours before a member's
``status`` saw it: ``machines.reconcile.halted_at``).

Revision ID: 0015
Revises: 0014
"""

from alembic import op
from sqlalchemy import text


revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None

#: how far a written instant may lie from the server's clock (see the module's doc)
SLACK = "10 minutes"

#: tables whose rows a member reads (all of them but tokens, which have their own policy)
READ_BY_MEMBERS = (
    "machines",
    "events",
    "usage_intervals",
    "heartbeats",
    "signed_marks",
    "scheduler_leases",
    "endpoint_outages",
    "budget_notices",
    "team_keys",
    "volumes",
    "deliveries",
    "team_rules",
    "team_members",
    "team_grants",
    "state_meta",
)

#: tables any role granted them reads, member or not
OPEN_TO_ANY = ("team_members", "team_rules", "state_meta")

#: tables only the scheduler (and an admin) write
SCHEDULER_WRITES = (
    "heartbeats",
    "signed_marks",
    "scheduler_leases",
    "endpoint_outages",
    "budget_notices",
    "team_keys",
)

#: tables only an admin writes
ADMIN_WRITES = ("team_rules", "team_members", "team_grants", "state_meta")


def _q(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _lit(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def _functions(s: str, owner: str) -> str:
    fixed = "SET search_path = pg_catalog, pg_temp"
    return f"""
CREATE FUNCTION {s}.prov_me() RETURNS text LANGUAGE plpgsql STABLE {fixed} AS $$
BEGIN
  RETURN (SELECT email::text FROM {s}.team_members WHERE role = current_user::text);
END
$$;
CREATE FUNCTION {s}.prov_kind() RETURNS text LANGUAGE plpgsql STABLE {fixed} AS $$
BEGIN
  RETURN (SELECT kind::text FROM {s}.team_members WHERE role = current_user::text);
END
$$;
CREATE FUNCTION {s}.prov_is_owner() RETURNS boolean LANGUAGE plpgsql STABLE {fixed} AS $$
BEGIN
  RETURN (SELECT pg_has_role(current_user, {_lit(owner)}, 'MEMBER')
      OR coalesce((SELECT rolsuper FROM pg_roles WHERE rolname = current_user), false));
END
$$;
CREATE FUNCTION {s}.prov_is_admin() RETURNS boolean LANGUAGE plpgsql STABLE {fixed} AS $$
BEGIN
  RETURN (SELECT {s}.prov_is_owner() OR coalesce({s}.prov_kind() = 'admin', false));
END
$$;
CREATE FUNCTION {s}.prov_is_staff() RETURNS boolean LANGUAGE plpgsql STABLE {fixed} AS $$
BEGIN
  RETURN {s}.prov_is_owner()
      OR coalesce({s}.prov_kind() IN ('admin', 'scheduler'), false);
END
$$;
CREATE FUNCTION {s}.prov_glob_regex(glob text) RETURNS text
LANGUAGE plpgsql IMMUTABLE {fixed} AS $$
DECLARE
  n int := length(glob);
  i int := 1;
  j int;
  c text;
  inner_ text;
  res text := '';
BEGIN
  WHILE i <= n LOOP
    c := substr(glob, i, 1);
    i := i + 1;
    IF c = '*' THEN
      IF right(res, 2) IS DISTINCT FROM '.*' THEN res := res || '.*'; END IF;
    ELSIF c = '?' THEN
      res := res || '.';
    ELSIF c = '[' THEN
      j := i;
      IF j <= n AND substr(glob, j, 1) = '!' THEN j := j + 1; END IF;
      IF j <= n AND substr(glob, j, 1) = ']' THEN j := j + 1; END IF;
      WHILE j <= n AND substr(glob, j, 1) <> ']' LOOP j := j + 1; END LOOP;
      IF j > n THEN
        res := res || '\\[';
      ELSE
        inner_ := {s}.prov_glob_set(substr(glob, i, j - i));
        i := j + 1;
        res := res || inner_;
      END IF;
    ELSE
      res := res || {s}.prov_glob_char(c);
    END IF;
  END LOOP;
  RETURN '^' || res || '$';
END
$$;
CREATE FUNCTION {s}.prov_glob_char(c text) RETURNS text
LANGUAGE plpgsql IMMUTABLE {fixed} AS $$
BEGIN
  RETURN (SELECT CASE WHEN c ~ '^[!-/:-@\\[-`{{-~]$' THEN '\\' || c ELSE c END);
END
$$;
CREATE FUNCTION {s}.prov_glob_set(stuff text) RETURNS text
LANGUAGE plpgsql IMMUTABLE {fixed} AS $$
-- a bracket's inside ('!' first: negated; 'a-z': a range, none when reversed, as fnmatch)
DECLARE
  neg boolean := left(stuff, 1) = '!';
  body text := CASE WHEN left(stuff, 1) = '!' THEN substr(stuff, 2) ELSE stuff END;
  n int;
  k int := 1;
  a text;
  b text;
  out_ text := '';
BEGIN
  n := length(body);
  WHILE k <= n LOOP
    a := substr(body, k, 1);
    IF k + 2 <= n AND substr(body, k + 1, 1) = '-' THEN
      b := substr(body, k + 2, 1);
      IF a <= b COLLATE "C" THEN
        out_ := out_ || {s}.prov_glob_char(a) || '-' || {s}.prov_glob_char(b);
      END IF;
      k := k + 3;
    ELSE
      out_ := out_ || {s}.prov_glob_char(a);
      k := k + 1;
    END IF;
  END LOOP;
  IF out_ = '' THEN
    RETURN CASE WHEN neg THEN '.' ELSE '(?!)' END;  -- fnmatch: '[!]' any, empty: nothing
  END IF;
  RETURN '[' || CASE WHEN neg THEN '^' ELSE '' END || out_ || ']';
END
$$;
CREATE FUNCTION {s}.prov_glob(value text, glob text) RETURNS boolean
LANGUAGE plpgsql IMMUTABLE {fixed} AS $$
BEGIN
  RETURN (SELECT value ~ {s}.prov_glob_regex(glob));
END
$$;
CREATE FUNCTION {s}.prov_may_act(owner text, project text) RETURNS boolean
LANGUAGE plpgsql STABLE {fixed} AS $$
DECLARE
  me text;
BEGIN
  IF {s}.prov_is_staff() THEN RETURN true; END IF;
  me := {s}.prov_me();
  IF me IS NULL THEN RETURN false; END IF;
  IF owner = me THEN RETURN true; END IF;
  RETURN EXISTS (
    SELECT 1 FROM {s}.team_grants g
    WHERE {s}.prov_glob(me, g.actor_glob)
      AND {s}.prov_glob(owner, g.owner_glob)
      AND {s}.prov_glob(project, g.project_glob));
END
$$;
CREATE FUNCTION {s}.prov_may_act_on(machine text) RETURNS boolean
LANGUAGE plpgsql STABLE {fixed} AS $$
BEGIN
  RETURN (SELECT coalesce((SELECT {s}.prov_may_act(m.owner, m.project)
                   FROM {s}.machines m WHERE m.id = machine), false));
END
$$;
CREATE FUNCTION {s}.prov_refuse(why text) RETURNS void
LANGUAGE plpgsql {fixed} AS $$
BEGIN
  RAISE EXCEPTION USING ERRCODE = 'insufficient_privilege', MESSAGE = 'not allowed: ' || why;
END
$$;
CREATE FUNCTION {s}.prov_clock_checked() RETURNS boolean LANGUAGE plpgsql STABLE {fixed} AS $$
BEGIN
  RETURN (SELECT NOT {s}.prov_is_owner() AND NOT EXISTS (
    SELECT 1 FROM {s}.state_meta WHERE key = 'clock' AND value = 'simulated'));
END
$$;
CREATE FUNCTION {s}.prov_check_instant(what text, at timestamptz, floor_ timestamptz)
RETURNS void LANGUAGE plpgsql {fixed} AS $$
BEGIN
  IF at IS NULL THEN RETURN; END IF;
  IF at > now() + interval '{SLACK}' THEN
    PERFORM {s}.prov_refuse(format('%s %s is after the server''s clock (%s): '
      'the client''s clock is off', what, at, date_trunc('second', now())));
  END IF;
  IF floor_ IS NOT NULL AND at < floor_ - interval '{SLACK}' THEN
    PERFORM {s}.prov_refuse(format('%s %s is more than {SLACK} before %s: '
      'is the client''s clock off?', what, at, date_trunc('second', floor_)));
  END IF;
END
$$;
"""


def _owned_guard(s: str) -> str:
    """machines and volumes: an UPDATE of a row whose old owner the caller may not act on."""
    return f"""
CREATE FUNCTION {s}.prov_refuse_owned(owner text, project text, what text) RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
  PERFORM {s}.prov_refuse(format('%s may not act for %s on project %s (%s)',
    coalesce({s}.prov_me(), current_user::text || ' (not a team member)'),
    owner, project, what));
END
$$;
CREATE FUNCTION {s}.prov_guard_owned() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
  IF {s}.prov_is_owner() THEN RETURN NEW; END IF;
  IF NOT {s}.prov_may_act(OLD.owner, OLD.project) THEN
    PERFORM {s}.prov_refuse_owned(OLD.owner, OLD.project, OLD.name);
  END IF;
  IF NOT {s}.prov_may_act(NEW.owner, NEW.project) THEN
    PERFORM {s}.prov_refuse_owned(NEW.owner, NEW.project, NEW.name);
  END IF;
  IF NEW.created_at IS DISTINCT FROM OLD.created_at THEN  -- the clock checks' floor
    PERFORM {s}.prov_refuse(format('%s %s: when it was made is history', TG_TABLE_NAME,
      OLD.name));
  END IF;
  RETURN NEW;
END
$$;
CREATE FUNCTION {s}.prov_guard_owned_new() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
  IF NOT {s}.prov_is_owner() AND NOT {s}.prov_may_act(NEW.owner, NEW.project) THEN
    PERFORM {s}.prov_refuse_owned(NEW.owner, NEW.project, NEW.name);
  END IF;
  RETURN NEW;
END
$$;
CREATE TRIGGER prov_guard_owned BEFORE UPDATE ON {s}.machines
  FOR EACH ROW EXECUTE FUNCTION {s}.prov_guard_owned();
CREATE TRIGGER prov_guard_owned_new BEFORE INSERT ON {s}.machines
  FOR EACH ROW EXECUTE FUNCTION {s}.prov_guard_owned_new();
CREATE TRIGGER prov_guard_owned BEFORE UPDATE ON {s}.volumes
  FOR EACH ROW EXECUTE FUNCTION {s}.prov_guard_owned();
CREATE TRIGGER prov_guard_owned_new BEFORE INSERT ON {s}.volumes
  FOR EACH ROW EXECUTE FUNCTION {s}.prov_guard_owned_new();
"""


def _ledger_guards(s: str) -> str:
    """events: the actor is the caller (the scheduler and an admin may name another: the
    dashboard acts for its signed-in user), on a machine the caller may act on, at an instant
    the clock allows; only ``detail`` changes later. usage_intervals: only an open interval
    is closed, at or after its start."""
    return f"""
CREATE FUNCTION {s}.prov_guard_event() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
  made timestamptz;
BEGIN
  IF {s}.prov_is_owner() THEN RETURN NEW; END IF;
  IF TG_OP = 'UPDATE' THEN
    IF (NEW.machine_id, NEW.at, NEW.kind, NEW.reason, NEW.actor)
       IS DISTINCT FROM (OLD.machine_id, OLD.at, OLD.kind, OLD.reason, OLD.actor) THEN
      PERFORM {s}.prov_refuse('an event is history: only its detail may change');
    END IF;
    RETURN NEW;
  END IF;
  IF NOT {s}.prov_is_staff() AND NEW.actor IS DISTINCT FROM {s}.prov_me() THEN
    PERFORM {s}.prov_refuse(format('an event of %s names %s as its actor',
      coalesce({s}.prov_me(), current_user::text || ' (not a team member)'),
      coalesce(NEW.actor, 'nobody')));
  END IF;
  IF NOT {s}.prov_may_act_on(NEW.machine_id) THEN
    PERFORM {s}.prov_refuse(format('%s may not act on machine %s',
      coalesce({s}.prov_me(), current_user::text), NEW.machine_id));
  END IF;
  IF {s}.prov_clock_checked() THEN
    SELECT created_at INTO made FROM {s}.machines WHERE id = NEW.machine_id;
    PERFORM {s}.prov_check_instant('event time', NEW.at, made);
  END IF;
  RETURN NEW;
END
$$;
CREATE TRIGGER prov_guard_event BEFORE INSERT OR UPDATE ON {s}.events
  FOR EACH ROW EXECUTE FUNCTION {s}.prov_guard_event();

CREATE FUNCTION {s}.prov_guard_usage() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
  made timestamptz;
BEGIN
  IF {s}.prov_is_owner() THEN RETURN NEW; END IF;
  IF NOT {s}.prov_may_act_on(NEW.machine_id) THEN
    PERFORM {s}.prov_refuse(format('%s may not act on machine %s',
      coalesce({s}.prov_me(), current_user::text), NEW.machine_id));
  END IF;
  IF TG_OP = 'UPDATE' THEN
    IF OLD.ended_at IS NOT NULL THEN
      PERFORM {s}.prov_refuse('a closed usage interval is the ledger: it never changes');
    END IF;
    IF (NEW.machine_id, NEW.kind, NEW.started_at, NEW.start_us, NEW.rate, NEW.currency)
       IS DISTINCT FROM
       (OLD.machine_id, OLD.kind, OLD.started_at, OLD.start_us, OLD.rate, OLD.currency) THEN
      PERFORM {s}.prov_refuse('an open usage interval may only be closed');
    END IF;
  END IF;
  IF NEW.ended_at IS NOT NULL AND NEW.ended_at < NEW.started_at THEN
    PERFORM {s}.prov_refuse('a usage interval cannot end before it starts');
  END IF;
  IF {s}.prov_clock_checked() THEN
    SELECT created_at INTO made FROM {s}.machines WHERE id = NEW.machine_id;
    PERFORM {s}.prov_check_instant('usage start', NEW.started_at, made);
    PERFORM {s}.prov_check_instant('usage end', NEW.ended_at, made);
  END IF;
  RETURN NEW;
END
$$;
CREATE TRIGGER prov_guard_usage BEFORE INSERT OR UPDATE ON {s}.usage_intervals
  FOR EACH ROW EXECUTE FUNCTION {s}.prov_guard_usage();

CREATE FUNCTION {s}.prov_guard_machine_clock() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
  IF NOT {s}.prov_clock_checked() THEN RETURN NEW; END IF;
  IF TG_OP = 'INSERT' THEN
    PERFORM {s}.prov_check_instant('created_at', NEW.created_at, now());
  END IF;
  IF TG_OP = 'INSERT' OR NEW.launched_at IS DISTINCT FROM OLD.launched_at THEN
    PERFORM {s}.prov_check_instant('launched_at', NEW.launched_at, NEW.created_at);
  END IF;
  IF TG_OP = 'INSERT' OR NEW.terminated_at IS DISTINCT FROM OLD.terminated_at THEN
    PERFORM {s}.prov_check_instant('terminated_at', NEW.terminated_at, NEW.created_at);
  END IF;
  RETURN NEW;
END
$$;
CREATE TRIGGER prov_guard_machine_clock BEFORE INSERT OR UPDATE ON {s}.machines
  FOR EACH ROW EXECUTE FUNCTION {s}.prov_guard_machine_clock();

CREATE FUNCTION {s}.prov_guard_token() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
  IF {s}.prov_is_owner() THEN RETURN NEW; END IF;
  IF TG_OP = 'INSERT' AND NOT {s}.prov_is_admin()
     AND (NEW."user" IS DISTINCT FROM {s}.prov_me()
          OR NEW.created_by IS DISTINCT FROM {s}.prov_me()) THEN
    PERFORM {s}.prov_refuse(format('%s may not create a token of %s (only an admin may)',
      coalesce({s}.prov_me(), current_user::text || ' (not a team member)'), NEW."user"));
  END IF;
  IF TG_OP = 'INSERT' AND {s}.prov_clock_checked() THEN
    PERFORM {s}.prov_check_instant('created_at', NEW.created_at, now());
  END IF;
  IF TG_OP = 'UPDATE' AND NOT {s}.prov_is_admin()
     AND NOT coalesce({s}.prov_me() IN (OLD."user", OLD.created_by), false) THEN
    PERFORM {s}.prov_refuse(format('%s may not revoke a token of %s',
      coalesce({s}.prov_me(), current_user::text), OLD."user"));
  END IF;
  RETURN NEW;
END
$$;
CREATE TRIGGER prov_guard_token BEFORE INSERT OR UPDATE ON {s}.tokens
  FOR EACH ROW EXECUTE FUNCTION {s}.prov_guard_token();

CREATE FUNCTION {s}.prov_append_only() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
  IF NOT {s}.prov_is_owner() THEN
    PERFORM {s}.prov_refuse(format('%s keeps every version: a change is a new one',
      TG_TABLE_NAME));
  END IF;
  RETURN CASE WHEN TG_OP = 'DELETE' THEN OLD ELSE NEW END;
END
$$;
CREATE TRIGGER prov_append_only BEFORE UPDATE OR DELETE ON {s}.team_rules
  FOR EACH ROW EXECUTE FUNCTION {s}.prov_append_only();
"""


def _policies(s: str) -> list[str]:
    # (SELECT f()): evaluated once per statement (an InitPlan), not once per row
    member = f"(SELECT {s}.prov_kind()) IS NOT NULL"
    staff, admin = f"(SELECT {s}.prov_is_staff())", f"(SELECT {s}.prov_is_admin())"
    owned = f"{s}.prov_may_act(owner, project)"
    on_machine = f"{s}.prov_may_act_on(machine_id)"
    me = f"(SELECT {s}.prov_me())"
    out = [f"ALTER TABLE {s}.{t} ENABLE ROW LEVEL SECURITY" for t in (*READ_BY_MEMBERS, "tokens")]
    # readable by any role granted it: the member map (the functions every other policy calls
    # read it, or each check would recurse into itself), the rules and the state's own facts
    # (its clock): so a role no member hears why it may not write, not a wrong reason
    out += [
        f"CREATE POLICY read ON {s}.{t} FOR SELECT USING"
        f" ({'true' if t in OPEN_TO_ANY else member})"
        for t in READ_BY_MEMBERS
    ]
    for t in ("machines", "volumes"):  # the trigger names the refusal; these are the floor
        out += [
            f"CREATE POLICY write ON {s}.{t} FOR INSERT WITH CHECK ({owned})",
            f"CREATE POLICY change ON {s}.{t} FOR UPDATE USING ({member}) WITH CHECK ({owned})",
            f"CREATE POLICY remove ON {s}.{t} FOR DELETE USING ({admin})",
        ]
    for t in ("events", "usage_intervals"):
        out += [
            f"CREATE POLICY write ON {s}.{t} FOR INSERT WITH CHECK ({on_machine})",
            f"CREATE POLICY change ON {s}.{t} FOR UPDATE USING ({member})"
            f" WITH CHECK ({on_machine})",
        ]
    out += [
        f"CREATE POLICY write ON {s}.deliveries FOR INSERT WITH CHECK ({member})",
        f"CREATE POLICY change ON {s}.deliveries FOR UPDATE USING ({staff})",
        f"CREATE POLICY remove ON {s}.deliveries FOR DELETE USING ({staff})",
        f'CREATE POLICY read ON {s}.tokens FOR SELECT USING ({staff} OR "user" = {me}'
        f" OR created_by = {me})",
        f'CREATE POLICY write ON {s}.tokens FOR INSERT WITH CHECK ({admin} OR "user" = {me})',
        f'CREATE POLICY change ON {s}.tokens FOR UPDATE USING ({admin} OR "user" = {me}'
        f" OR created_by = {me})",
    ]
    for t in SCHEDULER_WRITES:
        out += [
            f"CREATE POLICY write ON {s}.{t} FOR INSERT WITH CHECK ({staff})",
            f"CREATE POLICY change ON {s}.{t} FOR UPDATE USING ({staff})",
            f"CREATE POLICY remove ON {s}.{t} FOR DELETE USING ({staff})",
        ]
    for t in ADMIN_WRITES:
        out += [
            f"CREATE POLICY write ON {s}.{t} FOR INSERT WITH CHECK ({admin})",
            f"CREATE POLICY change ON {s}.{t} FOR UPDATE USING ({admin})",
            f"CREATE POLICY remove ON {s}.{t} FOR DELETE USING ({admin})",
        ]
    return out


def upgrade() -> None:
    conn = op.get_bind()
    if conn.dialect.name != "postgresql":
        return  # SQLite: one user's file, the OS guards it
    schema = str(conn.execute(text("SELECT current_schema()")).scalar())
    owner = str(conn.execute(text("SELECT current_user")).scalar())
    s = _q(schema)
    # the driver's own cursor, given no parameters: the bodies' format('%s') stay as written
    cur = conn.connection.cursor()
    for statement in (_functions(s, owner), _owned_guard(s), _ledger_guards(s), *_policies(s)):
        cur.execute(statement)


def downgrade() -> None:
    conn = op.get_bind()
    if conn.dialect.name != "postgresql":
        return
    s = _q(str(conn.execute(text("SELECT current_schema()")).scalar()))
    for t in (*READ_BY_MEMBERS, "tokens"):
        conn.exec_driver_sql(f"ALTER TABLE {s}.{t} DISABLE ROW LEVEL SECURITY")
        for (name,) in conn.execute(
            text("SELECT policyname FROM pg_policies WHERE schemaname = :s AND tablename = :t"),
            {"s": s.strip('"'), "t": t},
        ):
            conn.exec_driver_sql(f"DROP POLICY {_q(name)} ON {s}.{t}")
    conn.connection.cursor().execute(  # no parameters: the LIKE's '%' stays as written
        "DO $$ DECLARE f regprocedure; BEGIN FOR f IN SELECT p.oid::regprocedure FROM pg_proc p"
        f" WHERE p.pronamespace = {_lit(s)}::regnamespace"
        " AND p.proname LIKE 'prov\\_%' LOOP EXECUTE 'DROP FUNCTION ' || f || ' CASCADE';"
        " END LOOP; END $$"
    )
