"""The layers point one way (docs/ARCHITECTURE.md). providers/ imports nothing from provisioner/ or
policies/, policies/ nothing from provisioner/ or providers/, and each module of provisioner/
imports only modules below it in :data:`ORDER` — counting every import statement in the file:
at module level, inside a function, or for type checking only."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

#: provisioner's modules, lowest first. A module may import only those listed before it.
ORDER = [
    "provisioner",
    "provisioner.agent_guard",  # the machine guards itself: the standard library only
    "provisioner.agent",  # runs on the rented machine: the standard library only
    "provisioner.pyshrink",  # Python source without comments and docstrings (the agent shipped)
    "provisioner.money",
    "provisioner.console",  # what commands write: tables, JSON, rich's console on first use
    "provisioner.words",  # the message catalogs of each language (Babel, on first use)
    "provisioner.errors",
    "provisioner.redact",  # secrets out of text in any form: raw, escaped, encoded, split
    "provisioner.outbound",  # an HTTP POST only to public or allowed addresses, no redirects
    "provisioner.clock",
    "provisioner.secretfile",  # a key file trusted only as written, else replaced
    "provisioner.crashpoints",
    "provisioner.acting",  # who acts in this thread (a dashboard request's user)
    "provisioner.location",  # where settings and state live: the standard library only
    "provisioner.settings",
    "provisioner.workdir",  # an experiment's workdir: its files, checked before a launch
    "provisioner.spec",
    "provisioner.skypilot_resources",  # a SkyPilot task's resources as an experiment's
    "provisioner.skypilot",  # a SkyPilot task file read as an experiment
    "provisioner.pq",  # libpq through ctypes: status's reads of a PostgreSQL state
    "provisioner.schema",  # the migrations' revisions, without SQLAlchemy
    "provisioner.fleet",  # the fleet as `status` lists it: plain SQL, no ORM
    "provisioner.models",  # every table
    "provisioner.state",  # the database: engine, sessions, migrations
    "provisioner.team_sql",  # a team's roles: privileges granted, the database's refusals
    "provisioner.tries",  # a preempted machine's relaunch tries, from its events
    "provisioner.catalog_checks",  # price checks of catalog rows: GPU facts only
    "provisioner.identity",  # who runs provisioner (OS user, database role), act_as
    "provisioner.team",  # the team's rules in its state: policies, member map, act_as grants
    "provisioner.catalog",
    "provisioner.planner",  # pure ranking: offers × spec × policy check
    "provisioner.mail",
    "provisioner.realclock",  # a shifted clock looks, never writes or acts (but simulated)
    "provisioner.app",  # the context: settings, clock, database, providers, policies
    "provisioner.permits",  # who may act on a machine or volume; the refusal's words
    "provisioner.notify",  # notices to Telegram, Slack, webhooks, mail: queued, then delivered
    "provisioner.tokens",  # personal tokens, stored hashed
    "provisioner.ledger.periods",  # the ledger: periods, intervals, sums, projections
    "provisioner.ledger.record",
    "provisioner.ledger.sums",
    "provisioner.ledger.projections",
    "provisioner.ledger.unpriced",  # what the clouds bill at a rate not known here
    "provisioner.ledger",
    "provisioner.budget",  # budget rules and standing; no enforcement
    "provisioner.planning",  # an experiment's plan: offers, policy decision, budget projection
    "provisioner.web",  # the HTTP server: WSGI apps under path prefixes (waitress)
    "provisioner.outages",  # when the heartbeat endpoint refused or was down: silence not idle
    "provisioner.guard",  # the rules a machine enforces on itself, and who enforces each
    "provisioner.startup",  # what a machine is given at boot: the agent and its token
    "provisioner.boot",  # a launch's startup data put together: agent, supervisor, mounts
    "provisioner.fits",  # the startup data against each cloud's limits, before a launch
    "provisioner.heartbeats",  # heartbeats and notices: parsed, kept, pruned, the latest read
    "provisioner.idle",  # the idle signal: evidence, verdict, rules, idle now
    "provisioner.endpoint",  # the signed heartbeat endpoint: /v1/heartbeat, /v1/notice, /metrics
    "provisioner.keys",  # the SSH key a machine gets and `ssh` uses; the ssh-config
    "provisioner.machines.record",  # a machine's life: events, transitions, its cloud's calls
    "provisioner.machines.attempts",  # the typed launch attempt and what failures block
    "provisioner.machines.volumes",  # network disks: created, attached, mounted, removed
    "provisioner.machines.remote",  # jobs on a cloud machine over SSH (rsync, supervisor)
    "provisioner.machines.joblogs",  # each job's output kept with the state when it ends
    "provisioner.machines.workdirs",  # the workdir as `up` took it, kept with the state
    "provisioner.machines.jobs",  # the experiment's job: workdir, setup, run, exec, their ends
    "provisioner.machines.gpuqueue",  # jobs wait their turn for the machine's GPUs
    "provisioner.machines.pull",  # each machine's agent report read over SSH: idle behind NAT
    "provisioner.machines.guard_stops",  # a machine's own guard's stop, read back
    "provisioner.machines.launch",  # up: intent, attempts, adoption
    "provisioner.machines.actions",  # stop, start, down, many at once, wait until ready
    "provisioner.machines.waiting",  # an intent queued for capacity: its tries, its end
    "provisioner.machines.reconcile",  # observations, orphans, gc
    "provisioner.machines",
    "provisioner.ownership",  # rent or buy per GPU type
    "provisioner.efficiency",  # busy GPU-hours ÷ paid; spend unusual against its own days
    "provisioner.reports",  # the report model: numbers
    "provisioner.render",  # the report as text, HTML, chart, CSV and mail
    "provisioner.bill",  # the ledger beside each cloud's own bill
    "provisioner.jobs",
    "provisioner.jobs.passes",
    "provisioner.jobs.ended",  # a stop that ends a running job: its end recorded, owner told
    "provisioner.jobs.finish",  # lifecycle.on_finish: billing ends with the job
    "provisioner.jobs.lease",
    "provisioner.jobs.notices",
    "provisioner.jobs.reload",  # policy and settings edits reach the running scheduler
    "provisioner.jobs.autostop",  # stop when idle (GPUs, jobs, SSH) for that long, any hour
    "provisioner.jobs.sweep",
    "provisioner.jobs.recover",
    "provisioner.jobs.waiting",  # the scheduler's tries of intents waiting for capacity
    "provisioner.jobs.outlook",  # the next move on each machine: one decision for all
    "provisioner.jobs.reconcile",
    "provisioner.jobs.enforce",
    "provisioner.jobs.scheduled_reports",
    "provisioner.jobs.metrics",
    "provisioner.jobs.cycle",  # one cycle of every pass: the daemon's jobs, `sweep` once
    "provisioner.jobs.daemon",
    "provisioner.views",  # view models: what the CLI and the dashboard both show, made once
    "provisioner.views.status",
    "provisioner.views.plan",
    "provisioner.views.spend",
    "provisioner.views.alerts",  # alert history: notices and their deliveries
    "provisioner.views.summary",  # what burns now, counts, budgets, idle now
    "provisioner.views.fleet",  # the dashboard's fleet and machine pages
    "provisioner.workflows",  # a command end to end: typed request, progress events, result
    "provisioner.workflows.catalog",  # cheapest offers, price refresh, credentials checked
    "provisioner.workflows.up",  # up: resume, launch or wait, SSH, the due job, the run followed
    "provisioner.workflows.job_control",  # cancel, and logs read from the machine or the state
    "provisioner.workflows.many",  # stop, start, down of one machine or many
    "provisioner.workflows.gc",  # orphans, unused network pieces and volumes
    "provisioner.selftest",  # selftest --cloud C: one small real run checks the guard there
    "provisioner.dashboard.svg",  # the team dashboard: charts, page data, the WSGI app
    "provisioner.dashboard.pages",
    "provisioner.dashboard.wsgi",  # a request and a response: cookies, forms, headers, static
    "provisioner.dashboard.site",  # the frame: language, cache, Jinja2 pages
    "provisioner.dashboard.access",  # login, sessions, tokens, CSRF, the throttle
    "provisioner.dashboard.web",  # routing and the pages
    "provisioner.dashboard",
    "provisioner.cli",  # the Typer app and what every command shares
    "provisioner.cli.catalog",
    "provisioner.cli.jobs",  # logs, exec
    "provisioner.cli.launched",  # what up shows: its steps, the machine, the run's end
    "provisioner.cli.machines",
    "provisioner.cli.volumes",  # volume ls, volume rm
    "provisioner.cli.status",  # status (fleet and detail), events
    "provisioner.cli.report",
    "provisioner.cli.bill",
    "provisioner.cli.scheduler",
    "provisioner.cli.dashboard",
    "provisioner.cli.tokens",  # token create, list, revoke
    "provisioner.cli.policy",  # policy apply, diff, log, show: the team's rules
    "provisioner.cli.selftest",  # selftest --cloud C
    "provisioner.cli.main",  # the entry point: registers the commands and runs one
    "provisioner.entry",  # the console entry point: `status` without Typer if it can, else cli
    "provisioner.__main__",
]

#: Files of provisioner/ that are not modules of its packages, and what they may import from it.
SCRIPTS = {
    "provisioner/migrations/env.py": {"provisioner.models"},  # Alembic sees every table
    # the catalog build: each cloud's builder through the registry, GPU facts, and which GCP
    # shapes are sold as Spot only
    "provisioner/data/catalog/build.py": {"providers", "provisioner.catalog_checks"},
}

PACKAGES = ("provisioner", "providers", "policies")


def modules(package: str) -> dict[str, Path]:
    """Every module of ``package`` (files in directories that are packages), by dotted name."""
    out = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        rel = path.relative_to(ROOT)
        if not all((ROOT / p / "__init__.py").exists() for p in rel.parents if p != Path(".")):
            continue
        parts = rel.with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def scripts(package: str) -> list[Path]:
    """The other .py files under ``package``: Alembic's environment and migrations, data tools."""
    known = set(modules(package).values())
    return [p for p in sorted((ROOT / package).rglob("*.py")) if p not in known]


def imports(path: Path, name: str, known: set[str]) -> dict[str, int]:
    """Every module ``path`` imports (resolved to the longest known module name, or the
    top-level name for anything else), with the line of the first such import."""
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    out: dict[str, int] = {}

    def resolve(target: str) -> str:
        parts = target.split(".")
        for i in range(len(parts), 0, -1):
            if ".".join(parts[:i]) in known:
                return ".".join(parts[:i])
        return parts[0]

    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = name if is_pkg else name.rpartition(".")[0]
                for _ in range(node.level - 1):
                    pkg = pkg.rpartition(".")[0]
                base = f"{pkg}.{base}" if base else pkg
            targets = [f"{base}.{a.name}" for a in node.names]
        for t in targets:
            out.setdefault(resolve(t), node.lineno)
    return out


def known_modules() -> set[str]:
    return {m for p in PACKAGES for m in modules(p)}


def test_every_module_of_provisioner_has_its_place_in_the_order():
    found = set(modules("provisioner"))
    assert sorted(found - set(ORDER)) == [], "declare where these sit in ORDER"
    assert sorted(set(ORDER) - found) == [], "ORDER names modules that do not exist"
    assert len(ORDER) == len(set(ORDER))


def test_provisioner_modules_import_only_modules_below_them():
    known = known_modules()
    rank = {m: i for i, m in enumerate(ORDER)}
    wrong = []
    for name, path in modules("provisioner").items():
        for target, line in imports(path, name, known).items():
            if target.split(".")[0] != "provisioner" or target == name:
                continue
            if rank.get(target, len(ORDER)) >= rank.get(name, -1):
                wrong.append(f"{path.relative_to(ROOT)}:{line}: {name} imports {target}")
    assert wrong == []


def test_scripts_import_only_what_they_declare():
    known = known_modules()
    wrong = []
    for path in scripts("provisioner"):
        rel = str(path.relative_to(ROOT))
        got = {t for t in imports(path, "", known) if t.split(".")[0] in PACKAGES}
        if got - SCRIPTS.get(rel, set()):
            wrong.append(f"{rel} imports {sorted(got)}")
    assert wrong == []


#: The only modules that may import ``importlib``, and which of its parts: a dynamic import
#: would hide an edge from the checks above. Anything not listed here is refused.
IMPORTLIB_ALLOWED = {
    # the registry: adapters and specs loaded lazily by "module:Class", SDKs found without import
    "providers": {"importlib", "importlib.util"},
    # data files shipped inside the package (agent.py and its install script; the catalog CSVs)
    "provisioner.startup": {"importlib.resources"},
    "provisioner.catalog": {"importlib.resources"},
    "provisioner.cli": {"importlib.metadata"},  # the installed version, for --version
}


def importlib_uses(path: Path, name: str) -> list[str]:
    """Each import of ``importlib`` (any form, aliased or not) that :data:`IMPORTLIB_ALLOWED`
    does not grant ``name``, and each call of ``__import__`` or ``import_module`` outside the
    registry, as ``module:line: what``."""
    allowed = IMPORTLIB_ALLOWED.get(name, set())
    wrong = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        used: list[str] = []
        if isinstance(node, ast.Import):
            used = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            used = [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Call):
            f = node.func
            called = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            if called in ("import_module", "__import__") and "importlib" not in allowed:
                wrong.append(f"{name}:{node.lineno}: calls {called}")
        for target in used:
            if target.split(".")[0] != "importlib":
                continue
            if not any(target == a or target.startswith(a + ".") for a in allowed):
                wrong.append(f"{name}:{node.lineno}: imports {target}")
    return wrong


def test_no_dynamic_imports_hide_an_edge():
    """``importlib`` or ``__import__`` outside the registry would slip past the checks above."""
    wrong = [
        w for p in PACKAGES for name, path in modules(p).items() for w in importlib_uses(path, name)
    ]
    assert wrong == []
    assert set(IMPORTLIB_ALLOWED) <= known_modules(), "IMPORTLIB_ALLOWED names a missing module"


@pytest.mark.parametrize(
    ("name", "source"),
    [
        ("provisioner.planted", "from importlib import import_module as im\n"),
        ("provisioner.planted", "import importlib as il\n"),
        ("provisioner.planted", "import importlib.util\n"),
        ("provisioner.planted", "def f():\n    return __import__('provisioner.cli')\n"),
        ("policies.planted", "from importlib.resources import files\n"),
        # a module granted one part of importlib is refused another
        ("provisioner.cli", "from importlib import import_module\n"),
    ],
)
def test_a_planted_dynamic_import_is_caught(tmp_path, name, source):
    planted = tmp_path / "planted.py"
    planted.write_text(source)
    assert importlib_uses(planted, name) != []


@pytest.mark.parametrize(
    ("package", "forbidden"),
    [("providers", ("provisioner", "policies")), ("policies", ("provisioner", "providers"))],
)
def test_providers_and_policies_import_nothing_from_the_layers_above(package, forbidden):
    known = known_modules()
    wrong = [
        f"{path.relative_to(ROOT)}:{line}: {name} imports {target}"
        for name, path in modules(package).items()
        for target, line in imports(path, name, known).items()
        if target.split(".")[0] in forbidden
    ]
    assert wrong == []
    # and at run time: importing every module loads nothing from the layers above
    code = (
        f"import sys\nfor m in {sorted(modules(package))!r}:\n    __import__(m)\n"
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {forbidden!r}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_every_module_of_provisioner_imports():
    """Every module imports (Alembic's scripts run only under Alembic: parsed above instead)."""
    code = (
        f"import importlib\nfor m in {sorted(modules('provisioner'))!r}:\n"
        "    if m != 'provisioner.__main__':\n        importlib.import_module(m)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
