"""A bad workdir is refused before anything bills, and a job that cannot start after a launch
never leaves its machine billing unseen nor breaks ``status`` (issue 33: a FIFO in a workdir
made `up` fail after the launch with a traceback, the machine billing, and every `status` in
the team die; ``workdir: /`` passed `plan`, launched, walked 710,664 files and left the
machine running)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from sqlalchemy import select

from provisioner import machines
from provisioner.errors import UserError
from provisioner.jobs import finish
from provisioner.models import Machine
from provisioner.spec import load_experiment
from provisioner.workflows import up as flow
from tests.conftest import run_cli, sandbox_experiment, write_settings, write_yaml


def experiment(tmp_path: Path, name: str = "wd", **fields: object) -> Path:
    spec = sandbox_experiment(name)
    spec.update({"run": "ls", **fields})
    return write_yaml(tmp_path / f"{name}.yaml", spec)


def workdir(tmp_path: Path, n: int = 3) -> Path:
    work = tmp_path / "code"
    work.mkdir(exist_ok=True)
    for i in range(n):
        (work / f"f{i}.py").write_text("x = 1\n")
    return work


def refused(cfg: Path, spec: Path, *, env: dict | None = None) -> list[str]:
    """`plan` and `up` each refuse with exit 2 and one line; nothing is launched."""
    lines = []
    for cmd in ("plan", "up"):
        r = run_cli("--config", str(cfg), cmd, str(spec), env=env)
        assert r.returncode == 2, (cmd, r.stdout, r.stderr)
        assert "Traceback" not in r.stderr
        [line] = [x for x in (r.stdout + r.stderr).splitlines() if x.startswith("error:")]
        lines.append(line)
    r = run_cli("--config", str(cfg), "status", "--all", env=env)
    assert r.returncode == 0 and "no machines" in r.stdout, r.stdout
    return lines


def test_a_special_file_in_the_workdir_is_refused_with_its_path(home, tmp_path):
    work = workdir(tmp_path)
    os.mkfifo(work / "pipe")
    spec = experiment(tmp_path, workdir="code")
    at = spec.read_text().splitlines().index("workdir: code") + 1
    for line in refused(write_settings(home), spec):
        assert line == (
            f"error: {spec}:{at}: workdir: {work / 'pipe'} is a named pipe: a workdir holds "
            "regular files only"
        )


def test_a_symlink_to_a_device_is_refused_as_the_device(home, tmp_path):
    work = workdir(tmp_path)
    (work / "zero").symlink_to("/dev/zero")
    [line, _] = refused(write_settings(home), experiment(tmp_path, workdir="code"))
    assert f"{work / 'zero'} is a character device" in line


def test_the_root_and_the_home_directory_are_refused(home, tmp_path):
    cfg = write_settings(home)
    [line, _] = refused(cfg, experiment(tmp_path, workdir="/"))
    assert line.endswith("workdir: / is the whole file system: name the folder of your code")
    fake_home = tmp_path / "me"
    fake_home.mkdir()
    [line, _] = refused(
        cfg, experiment(tmp_path, workdir=str(fake_home)), env={"HOME": str(fake_home)}
    )
    assert line.endswith(
        f"workdir: {fake_home} is the home directory: name the folder of your code"
    )


def test_file_count_and_size_limits_come_from_settings(home, tmp_path):
    workdir(tmp_path, n=4)
    spec = experiment(tmp_path, workdir="code")
    [line, _] = refused(write_settings(home, workdir={"max_files": 3}), spec)
    assert "has more than 3 files to copy (workdir.max_files in settings)" in line
    (tmp_path / "code" / "big.bin").write_bytes(b"\0" * 2000)
    [line, _] = refused(write_settings(home, workdir={"max_bytes": 1000}), spec)
    assert "has more than 1,000 bytes to copy (workdir.max_bytes in settings)" in line
    r = run_cli("--config", str(write_settings(home)), "plan", str(spec))  # the defaults
    assert r.returncode == 0, r.stdout + r.stderr


def test_a_workdir_that_turns_bad_after_the_check_is_refused_before_anything_launches(
    app, home, tmp_path
):
    """`up` takes the workdir (kept with the state, issue #34) before it writes the intent: a
    named pipe that appeared after the check refuses the `up` (exit 2), nothing launched."""
    machines.up(app, load_experiment(experiment(tmp_path, "fine", run=None)))
    work = workdir(tmp_path)
    exp = load_experiment(experiment(tmp_path, workdir="code"))  # checked: fine
    os.mkfifo(work / "pipe")  # then a named pipe appears before the copy
    with pytest.raises(UserError) as e:  # `up`'s workflow: one line, exit 2
        flow.up(app, flow.UpRequest(exp, "wd.yaml", follow=False))
    assert e.value.exit_code == 2
    assert str(e.value) == (
        f"workdir: {work / 'pipe'} is a named pipe: a workdir holds regular files only"
    )
    with app.db.session() as s:
        assert [m.name for m in s.scalars(select(Machine))] == ["fine"]  # no intent left
    # the others' status is unharmed
    assert finish.check(app) == []
    cfg = write_settings(home, state_url=app.settings.state_url)
    r = run_cli("status", env={"PROVISIONER_CONFIG": str(cfg)})
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert "fine" in r.stdout
