"""SkyPilot task files (``sky launch task.yaml``) read as experiments, each field SkyPilot has
either mapped onto the experiment's own or refused with the reason, every refusal with its file,
line and field, all at once (docs/SKYPILOT.md has the table; tests/test_skypilot.py runs it on
task files from SkyPilot's own examples).

Which a file is (``--format auto``): a SkyPilot task when it has a key only SkyPilot has (top
level: :data:`SKYPILOT_ONLY`; under ``resources``: :data:`SKYPILOT_RESOURCES`) and none only an
experiment has (:data:`EXPERIMENT_ONLY`, :data:`EXPERIMENT_RESOURCES`); else an experiment file.
A file of only ``name``/``setup``/``run``/``workdir`` is read as an experiment: ``--format
skypilot`` says otherwise.

The field names and forms are SkyPilot's task schema (sky/utils/schemas.py ``get_task_schema``,
``get_resources_schema``, skypilot-org/skypilot at 00052dfe) and sky/task.py
``Task.from_yaml_config``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from policies import yamlfile
from policies.problems import DocumentError, Problem
from provisioner import spec
from provisioner.errors import UserError
from provisioner.skypilot_resources import SKYPILOT_RESOURCES, Resources

#: An experiment file's top-level keys a SkyPilot task has no field of that name for.
EXPERIMENT_ONLY = frozenset(
    {"project", "owner", "env", "lifecycle", "labels", "startup_script", "ssh_public_key"}
)
EXPERIMENT_RESOURCES = frozenset(
    {"gpu", "market", "clouds", "regions", "zones", "max_price_per_hour", "min_vcpus"}
    | {"min_memory_gb", "disk_gb", "image"}
)
#: SkyPilot's top-level task keys an experiment has no field of that name for.
SKYPILOT_ONLY = frozenset(
    {"envs", "num_nodes", "file_mounts", "secrets", "service", "config", "experimental"}
    | {"event_callback", "inputs", "outputs", "pool", "volume_mounts", "managed_secrets"}
    | {"api_server_access", "file_mounts_mapping", "_metadata"}
)

# an object store URL in file_mounts (sky/data/data_utils.py is_cloud_store_url's schemes)
_BUCKET = re.compile(r"^[a-z0-9]+://", re.I)
#: the first line of setup and run: SkyPilot runs them with bash (provisioner with sh, which
#: gives a script its path as $0), so bash's syntax ([[ ]], {1..9}) works as there
_BASH = '[ -n "$BASH_VERSION" ] || exec bash "$0" "$@"  # SkyPilot runs setup and run with bash\n'

_REFUSED_TOP = {
    "service": "SkyServe services (replicas, readiness probe, load balancer) are not supported: "
    "provisioner runs one machine per task",
    "config": "SkyPilot config overrides have no provisioner equivalent (its settings.yaml "
    "holds what may be set)",
    "experimental": "SkyPilot's experimental overrides have no provisioner equivalent",
    "secrets": "secrets are not supported yet: provisioner keeps env with the machine's "
    "state, where a secret must not be; pass it to the machine another way",
    "managed_secrets": "SkyPilot's managed secrets are not supported",
    "pool": "worker pools are not supported: provisioner runs one machine per task",
    "volumes": "SkyPilot volumes are not supported here: write an experiment file with "
    "volumes: (provisioner's network disks)",
    "volume_mounts": "SkyPilot volumes are not supported here: write an experiment file with "
    "volumes: (provisioner's network disks)",
    "event_callback": "event callbacks are not supported",
    "inputs": "inputs (SkyPilot's experimental egress estimate) are not supported",
    "outputs": "outputs (SkyPilot's experimental egress estimate) are not supported",
    "api_server_access": "there is no API server to give access to",
}


@dataclass(frozen=True)
class Overrides:
    """What the command line changes in the file, as ``sky launch``'s flags do: ``--env
    KEY=VALUE`` (or ``--env KEY``: from this process's environment), ``--gpus``, ``--cloud``."""

    env: Sequence[str] = ()
    gpus: str | None = None
    cloud: str | None = None


@dataclass(frozen=True)
class Loaded:
    experiment: spec.Experiment
    format: Literal["experiment", "skypilot"]
    #: what the translation did that a SkyPilot user should know (a name changed, a field
    #: accepted without effect), one line each
    notes: tuple[str, ...] = ()


def load(
    path: str | Path,
    currencies: Collection[str] | None = None,
    actor: Callable[[], str] | None = None,
    workdir_limits: tuple[int, int] | None = None,
    *,
    fmt: str = "auto",
    overrides: Overrides = Overrides(),
) -> Loaded:
    """An experiment file or a SkyPilot task file (``fmt``), as an experiment; DocumentError
    (exit 2) with every problem, UserError for a bad override."""
    data, lines = yamlfile.load_document(path)
    env = parse_env(overrides.env)
    context = spec.experiment_context(path, currencies, actor, workdir_limits)
    if fmt == "skypilot" or (fmt == "auto" and is_skypilot(data)):
        if not isinstance(data, dict):
            raise DocumentError([Problem(str(path), 1, None, "a task file must be a mapping")])
        t = _Translation(str(path), lines)
        t.task(data, env, overrides)
        return Loaded(t.validate(context), "skypilot", tuple(t.notes))
    if overrides.gpus or overrides.cloud:
        raise UserError(
            "--gpus and --cloud change a SkyPilot task file's resources; in an experiment "
            "file, edit resources: (or give --format skypilot)"
        )
    if env and isinstance(data, dict):
        own = data.get("env")
        data = {**data, "env": {**(own if isinstance(own, dict) else {}), **env}}
    try:
        return Loaded(spec.validate_experiment(data, lines, path, context), "experiment")
    except DocumentError as e:
        raise DocumentError([_hinted(p, data) for p in e.problems]) from None


#: SkyPilot's names an experiment writes otherwise
_EXPERIMENT_NAME = {
    "envs": "env",
    "accelerators": "gpu",
    "use_spot": "market",
    "disk_size": "disk_gb",
    "cloud": "clouds",
    "region": "regions",
    "zone": "zones",
    "cpus": "min_vcpus",
    "memory": "min_memory_gb",
    "image_id": "image",
    "max_hourly_cost": "max_price_per_hour",
}


def _hinted(p: Problem, data: Any) -> Problem:
    """An unknown field of an experiment file that is SkyPilot's name: said so, with the
    experiment's name for it, or why the file was not read as a SkyPilot task."""
    key = (p.field or "").rpartition(".")[2]
    if not p.message.startswith("unknown field") or not (
        key in SKYPILOT_ONLY or key in SKYPILOT_RESOURCES
    ):
        return p
    if key in _EXPERIMENT_NAME:
        hint = f"{key} is SkyPilot's name; an experiment's is {_EXPERIMENT_NAME[key]}"
    else:
        hint = f"{key} is a SkyPilot task field"
    own = sorted(EXPERIMENT_ONLY & set(data)) if isinstance(data, dict) else []
    why = f" (read as an experiment: it has {', '.join(own)}" if own else " (read as an experiment"
    return Problem(p.file, p.line, p.field, f"{hint}{why}; docs/SKYPILOT.md)")


def is_skypilot(data: Any) -> bool:
    """The rule in this module's docstring."""
    if not isinstance(data, dict):
        return False
    res = data.get("resources")
    res_keys = set(res) if isinstance(res, dict) else set()
    if EXPERIMENT_ONLY & set(data) or EXPERIMENT_RESOURCES & res_keys:
        return False
    return bool(SKYPILOT_ONLY & set(data) or SKYPILOT_RESOURCES & res_keys)


def parse_env(items: Sequence[str]) -> dict[str, str]:
    """``--env KEY=VALUE`` or ``--env KEY`` (this process's value, as ``sky launch --env``)."""
    out: dict[str, str] = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise UserError(f"--env {item!r}: write KEY=VALUE (or KEY, to pass yours)")
        if not eq:
            if key not in os.environ:
                raise UserError(f"--env {key}: {key} is not set here; write {key}=VALUE")
            value = os.environ[key]
        out[key] = value
    return out


def machine_name(name: str) -> str:
    """A SkyPilot task name (letters, digits, ``_.-``) as a machine name: lowercase letters,
    digits and dashes, starting with a letter, at most 40."""
    out = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    if len(out) < 2 or not out[0].isalpha():
        out = "sky-" + out
    return out[:40].rstrip("-")


@dataclass
class _Translation:
    file: str
    lines: yamlfile.Lines
    out: dict[str, Any] = field(default_factory=dict)
    problems: list[Problem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    #: the experiment's field (dotted) → the task's, to say a validation error where it was
    #: written; its lines in ``exp_lines``
    names: dict[str, str] = field(default_factory=dict)
    exp_lines: yamlfile.Lines = field(default_factory=yamlfile.Lines)
    #: experiment fields left out because the task's were refused (their "Field required"
    #: would say the same again)
    refused: set[str] = field(default_factory=set)

    # ---- bookkeeping ----------------------------------------------------------------------

    def refuse(self, loc: tuple[Any, ...], reason: str) -> None:
        where = ".".join(str(x) for x in loc) or None
        self.problems.append(Problem(self.file, self.lines.line_for(loc), where, reason))

    def put(self, exp: tuple[str, ...], value: Any, sky: tuple[Any, ...]) -> None:
        d = self.out
        for k in exp[:-1]:
            d = d.setdefault(k, {})
        d[exp[-1]] = value
        self.exp_lines.lines[exp] = self.lines.line_for(sky) or 1
        self.names[".".join(exp)] = ".".join(str(x) for x in sky)

    def validate(self, context: dict[str, Any]) -> spec.Experiment:
        """The experiment, or every problem: the translation's and the experiment's own (a
        GPU type it does not know, a workdir that is not there), each at the task's field."""
        from pydantic import ValidationError

        try:
            experiment = spec.Experiment.model_validate(self.out, context=context)
        except ValidationError as e:
            found = yamlfile.problems_from(
                e, self.exp_lines, self.file, self.out, model=spec.Experiment
            )
            self.problems.extend(self._renamed(p) for p in found if p.field not in self.refused)
            experiment = None
        if self.problems or experiment is None:
            raise DocumentError(sorted(self.problems, key=lambda p: (p.line or 0, p.field or "")))
        return experiment

    def _renamed(self, p: Problem) -> Problem:
        """An experiment field's problem at the task field it came from."""
        name = p.field or ""
        while name and name not in self.names:
            name = name.rpartition(".")[0]
        if not name:
            return p
        line = self.exp_lines.lines.get(tuple(name.split(".")), p.line)
        return Problem(p.file, line, self.names[name], p.message)

    # ---- the task ---------------------------------------------------------------------------

    def task(self, data: dict[str, Any], env: dict[str, str], o: Overrides) -> None:
        for key in data:
            if key in _REFUSED_TOP:
                self.refuse((key,), _REFUSED_TOP[key])
            elif key not in {"name", "workdir", "setup", "run", "envs", "num_nodes"} | {
                "file_mounts",
                "resources",
            }:
                self.refuse((key,), "unknown SkyPilot task field")
        self._name(data.get("name"))
        self.put(("project",), _project(self.file), ())
        self._workdir(data.get("workdir"))
        for key in ("setup", "run"):
            if isinstance(data.get(key), str):
                self.put((key,), _BASH + data[key], (key,))
            elif data.get(key) is not None:
                self.refuse((key,), "should be a shell script (a string)")
        self._num_nodes(data.get("num_nodes"))
        self._file_mounts(data.get("file_mounts"))
        res = data.get("resources")
        if res is not None and not isinstance(res, dict):
            self.refuse(("resources",), "should be a mapping of keys (key: value)")
            res = {}
        count = Resources(self, dict(res or {}), o.gpus, o.cloud).translate()
        self._envs(data.get("envs"), env, count)

    def _name(self, name: Any) -> None:
        stem = machine_name(Path(self.file).stem)
        if name is None:
            self.put(("name",), stem, ())
            self.notes.append(f"no name: the machine is {stem} (the file's name)")
            return
        made = machine_name(str(name))
        if made != name:
            self.notes.append(f"name {name}: the machine is {made}")
        self.put(("name",), made, ("name",))

    def _workdir(self, workdir: Any) -> None:
        if workdir is None:
            return
        if isinstance(workdir, dict):
            self.refuse(("workdir",), "a git workdir (url, ref) is not supported: clone in setup")
            return
        # relative to the current directory, as SkyPilot has it (sky/task.py Task._validate:
        # os.path.abspath(os.path.expanduser(workdir))), not to the file as in an experiment
        path = os.path.abspath(os.path.expanduser(str(workdir)))
        if not os.path.isdir(path):
            self.refuse(("workdir",), f"no directory {path} (relative to the current directory)")
            return
        self.put(("workdir",), path, ("workdir",))

    def _num_nodes(self, n: Any) -> None:
        if n is None or n == 1:
            return
        if isinstance(n, int) and not isinstance(n, bool) and n > 1:
            self.refuse(
                ("num_nodes",),
                f"{n} nodes: a multi-node cluster is not supported, provisioner runs a task on "
                "one machine (num_nodes: 1)",
            )
        else:
            self.refuse(("num_nodes",), "should be a whole number of nodes, 1 or more")

    def _file_mounts(self, mounts: Any) -> None:
        if mounts is None:
            return
        if not isinstance(mounts, dict):
            self.refuse(("file_mounts",), "should be a mapping of keys (key: value)")
            return
        for dst, src in mounts.items():
            if isinstance(src, dict) or (isinstance(src, str) and _BUCKET.match(src)):
                self.refuse(
                    ("file_mounts", dst), "buckets not supported yet (object storage mounts)"
                )
            else:
                self.refuse(
                    ("file_mounts", dst),
                    f"copying {src} to {dst} is not supported yet: put it in workdir (copied "
                    "to the machine) and use it from there",
                )

    def _envs(self, envs: Any, given: dict[str, str], gpus: int) -> None:
        if envs is not None and not isinstance(envs, dict):
            self.refuse(("envs",), "should be a mapping of keys (key: value)")
            envs = {}
        # what SkyPilot sets for setup and run on a one-node cluster (docs: running-jobs/
        # environment-variables, "SkyPilot environment variables"), unless the task does
        out: dict[str, Any] = {
            "SKYPILOT_NUM_GPUS_PER_NODE": str(gpus),
            "SKYPILOT_NUM_NODES": "1",
            "SKYPILOT_NODE_RANK": "0",
            "SKYPILOT_NODE_IPS": "127.0.0.1",
        }
        for key, value in (envs or {}).items():
            if key in given:
                value = given[key]
            elif value is None or value == "":
                # null (or empty): required, given with --env (SkyPilot docs,
                # running-jobs/environment-variables: "set it to an empty string or null")
                self.refuse(("envs", key), f"required: give it with --env {key}=VALUE")
                continue
            elif not re.fullmatch(r"[A-Z_][A-Z0-9_]*", str(key)):
                self.refuse(("envs", key), "provisioner's env names are A-Z, 0-9 and _")
                continue
            elif isinstance(value, dict | list):
                self.refuse(("envs", key), "should be a string, number or boolean")
                continue
            out[str(key)] = value
        out.update(given)
        self.put(("env",), {}, ("envs",))
        for key, value in out.items():
            sky = ("envs", key) if key in (envs or {}) else ("envs",)
            self.put(("env", key), value, sky)


def _project(file: str) -> str:
    """SkyPilot has no project: the folder the task file is in (budgets and reports group by
    it), as a label may be written."""
    folder = Path(file).resolve().parent.name
    return re.sub(r"[^A-Za-z0-9._-]+", "-", folder).strip("-")[:63] or "skypilot"
