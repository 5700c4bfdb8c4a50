"""Volumes: a network disk per project and name, created once in the machine's zone, attached
and mounted at every launch, billed until `volume rm` and never removed by `down`. On the
sandbox, on a manual clock."""

from __future__ import annotations

import json
import os
import re
import shutil
import sqlite3
import subprocess
from datetime import timedelta
from decimal import Decimal

import pytest
from sqlalchemy import select

from provisioner import ledger, machines, startup
from provisioner.app import App
from provisioner.clock import ManualClock
from provisioner.errors import ConfigError, OperationFailed, UserError
from provisioner.jobs import reconcile, recover
from provisioner.machines import volumes
from provisioner.models import Machine, UsageInterval, Volume
from provisioner.planning import plan
from provisioner.settings import load_settings
from provisioner.spec import Experiment, load_experiment
from tests.conftest import sandbox_experiment, write_settings, write_yaml

pytest_plugins = ["tests.cli_runner"]  # the `cli` fixture

# 73 GB at the sandbox's 0.10 USD per GB-month over 730 hours: 0.01 USD an hour, exactly
CKPT = {"name": "ckpt", "size_gb": 73, "path": "/data"}
HOURLY = Decimal("0.01")


def experiment(name: str = "exp", vols: list[dict] | None = None, **data: object) -> Experiment:
    d = sandbox_experiment(name)
    d["volumes"] = [CKPT] if vols is None else vols
    d.update(data)
    return Experiment.model_validate(d)


def sandbox_volumes(app: App) -> list[sqlite3.Row]:
    db = sqlite3.connect(app.provider("sandbox").db_path)  # type: ignore[attr-defined]
    db.row_factory = sqlite3.Row
    try:
        return db.execute("SELECT * FROM volumes ORDER BY created_at").fetchall()
    finally:
        db.close()


def user_data(app: App, instance_id: str) -> str:
    db = sqlite3.connect(app.provider("sandbox").db_path)  # type: ignore[attr-defined]
    try:
        return db.execute("SELECT user_data FROM machines WHERE id = ?", (instance_id,)).fetchone()[
            0
        ]
    finally:
        db.close()


def volume_spend(app: App, start, end) -> Decimal:
    with app.db.session() as s:
        by_kind = ledger.spend_by(s, start, end, ("kind",))
    return by_kind.get(("volume",), {}).get("USD", Decimal(0))  # type: ignore[call-overload]


# --- the experiment file ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("volume", "field", "words"),
    [
        ({"name": "Ckpt", "size_gb": 10, "path": "/data"}, "name", "lowercase"),
        ({"name": "ckpt", "size_gb": 0, "path": "/data"}, "size_gb", "greater than or equal"),
        ({"name": "ckpt", "size_gb": 70000, "path": "/data"}, "size_gb", "less than or equal"),
        ({"name": "ckpt", "size_gb": 10, "path": "data"}, "path", "absolute path"),
        ({"name": "ckpt", "size_gb": 10, "path": "/"}, "path", "absolute path"),
        ({"name": "ckpt", "size_gb": 10, "path": "/etc/ckpt"}, "path", "system directory"),
        ({"name": "ckpt", "size_gb": 10, "path": "/usr"}, "path", "system directory"),
        ({"name": "ckpt", "size_gb": 10, "path": "/data/../etc"}, "path", "absolute path"),
        ({"name": "ckpt", "size_gb": 10}, "path", "required"),
    ],
)
def test_a_bad_volume_is_named_with_its_file_line_and_field(tmp_path, volume, field, words):
    d = sandbox_experiment()
    d["volumes"] = [volume]
    path = write_yaml(tmp_path / "exp.yaml", d)
    with pytest.raises(ConfigError) as e:
        load_experiment(path)
    text = str(e.value)
    assert str(path) in text and f"volumes.0.{field}" in text, text
    assert words in text, text


def test_two_volumes_of_one_name_or_one_path_are_refused(tmp_path):
    for second in ({**CKPT, "path": "/other"}, {**CKPT, "name": "other"}):
        d = sandbox_experiment()
        d["volumes"] = [CKPT, second]
        with pytest.raises(ConfigError, match="two volumes with the"):
            load_experiment(write_yaml(tmp_path / "exp.yaml", d))
    d = sandbox_experiment()
    d["volumes"] = [{**CKPT, "name": f"v{i}", "path": f"/d{i}"} for i in range(9)]
    with pytest.raises(ConfigError, match="at most 8"):
        load_experiment(write_yaml(tmp_path / "exp.yaml", d))


def test_bad_volumes_exit_2_at_the_command_line(cli, home, tmp_path):
    cfg = write_settings(home)
    d = sandbox_experiment()
    d["volumes"] = [{**CKPT, "path": "/proc/x"}]
    r = cli("--config", str(cfg), "plan", str(write_yaml(tmp_path / "exp.yaml", d)))
    assert r.code == 2 and "Traceback" not in r.err
    assert re.search(r"exp\.yaml:\d+: volumes\.0\.path: /proc/x is a system directory", r.err)


# --- up, the zone, the pin ----------------------------------------------------------------------


def test_up_creates_the_volume_in_the_machines_zone_attaches_and_mounts_it(app):
    app.provider("sandbox").inject(capacity={"sandbox-us-1a": 0})  # the cheapest zone is full
    m = machines.up(app, experiment()).machine
    assert m.zone == "sandbox-us-1b"
    (cv,) = sandbox_volumes(app)
    assert (cv["zone"], cv["size_gb"], cv["attached_to"]) == ("sandbox-us-1b", 73, m.instance_id)
    assert json.loads(cv["labels"])["managed-by"] == "provisioner"
    # the startup data waits for the disk where the machine sees it, then mounts it at /data
    data = user_data(app, m.instance_id or "")
    assert f"pv_mount '/dev/disk/by-id/virtio-{cv['id']}' '/data' 'provisioner'" in data
    with app.db.session() as s:
        (v,) = volumes.live(s, "demo")
        assert (v.status, v.attached_machine_id, v.volume_id) == ("in-use", m.id, cv["id"])
        assert v.rate == HOURLY


def test_a_failed_launch_leaves_no_empty_volume_in_the_zone_it_left(app):
    sandbox = app.provider("sandbox")
    sandbox.inject(capacity={"sandbox-us-1a": 0})  # the launch fails there, after the create
    calls = []
    real = sandbox.volumes.create

    def create(request):
        calls.append(request.zone)
        return real(request)

    sandbox.volumes.create = create  # type: ignore[method-assign]
    m = machines.up(app, experiment()).machine
    assert calls[0] == "sandbox-us-1a" and m.zone == calls[-1] == "sandbox-us-1b"
    (cv,) = sandbox_volumes(app)  # the one in 1a was removed again
    assert cv["zone"] == "sandbox-us-1b"
    with app.db.session() as s:
        rows = list(s.scalars(select(Volume).order_by(Volume.created_at)))
    assert [r.status for r in rows] == ["deleted", "in-use"]


def test_the_plan_is_pinned_to_the_volumes_zone_and_a_second_up_reuses_it(app, cli, home, tmp_path):
    sandbox = app.provider("sandbox")
    sandbox.inject(capacity={"sandbox-us-1a": 0})
    first = machines.up(app, experiment("first")).machine
    machines.down(app, "first")
    sandbox.inject(capacity={})  # 1a is free and cheapest again: the volume still decides
    p = plan(app, experiment("second"))
    assert {(c.offer.cloud, c.offer.zone) for c in p.candidates} == {("sandbox", "sandbox-us-1b")}
    assert "pinned to sandbox sandbox-us-1b by volume ckpt" in [str(c) for c in p.checks]
    assert p.rejected["pinned to sandbox sandbox-us-1b by volume ckpt"] > 0
    second = machines.up(app, experiment("second")).machine
    assert second.zone == "sandbox-us-1b" and second.id != first.id
    (cv,) = sandbox_volumes(app)  # no second create
    assert cv["attached_to"] == second.instance_id

    cfg = write_settings(home, state_url=app.settings.state_url)  # the same state and sandbox
    spec = write_yaml(tmp_path / "third.yaml", experiment("third").to_json())
    r = cli("--config", str(cfg), "plan", str(spec), "-o", "json")
    checks = json.loads(r.out)["checks"]
    assert {
        "check": "volume-pin",
        "cloud": "sandbox",
        "region": "sandbox-us",
        "zone": "sandbox-us-1b",
        "volume": "ckpt",
        "message": "pinned to sandbox sandbox-us-1b by volume ckpt",
    } in checks


def test_a_volume_attached_to_another_live_machine_is_refused_before_any_launch(app):
    machines.up(app, experiment("first"))
    calls_before = app.provider("sandbox").api_calls  # type: ignore[attr-defined]
    with pytest.raises(UserError, match="volume ckpt of project demo is attached to first"):
        machines.up(app, experiment("second"))
    assert app.provider("sandbox").api_calls == calls_before  # type: ignore[attr-defined]
    with app.db.session() as s:
        assert s.scalars(select(Machine).where(Machine.name == "second")).first() is None


# --- billing, down, rm --------------------------------------------------------------------------


def test_down_keeps_the_volume_billing_until_volume_rm(app, clock):
    t0 = clock.now()
    machines.up(app, experiment())
    clock.advance(timedelta(hours=10))
    machines.down(app, "exp")
    (cv,) = sandbox_volumes(app)
    assert cv["attached_to"] is None  # terminated: detached, kept
    clock.advance(timedelta(hours=10))
    assert volume_spend(app, t0, clock.now()) == HOURLY * 20
    with app.db.session() as s:  # counted for its project and owner, like a machine
        by = ledger.spend_by(s, t0, clock.now(), ("project", "owner", "kind"))
    assert by[("demo", "ana@example.com", "volume")]["USD"] == HOURLY * 20  # type: ignore[index]
    (listed,) = volumes.listing(app)
    assert (listed.status, listed.attached_to, listed.spent[0].amount) == (
        "available",
        None,
        HOURLY * 20,
    )
    gone = volumes.remove(app, volumes.find(app, "ckpt", None))
    assert gone.status == "deleted" and sandbox_volumes(app) == []
    clock.advance(timedelta(hours=5))
    assert volume_spend(app, t0, clock.now()) == HOURLY * 20  # billing ended at the delete
    assert volumes.listing(app) == []


def test_volume_rm_asks_refuses_while_attached_and_deletes_with_yes(cli, home, tmp_path):
    cfg = write_settings(home)
    a = App(load_settings(cfg), ManualClock(_cli_now()))
    machines.up(a, experiment())
    a.close()
    r = cli("--config", str(cfg), "volume", "rm", "ckpt", "--yes")
    assert r.code == 2 and "attached to exp (running)" in r.err and "provisioner down exp" in r.err
    assert cli("--config", str(cfg), "down", "exp", "--yes").code == 0
    r = cli("--config", str(cfg), "volume", "ls", "-o", "json")
    (v,) = json.loads(r.out)["volumes"]
    assert (v["name"], v["status"], v["attached_to"], v["zone"]) == (
        "ckpt",
        "available",
        None,
        "sandbox-us-1a",
    )
    assert v["rate_per_hour"] == {"amount": "0.01", "currency": "USD"}
    r = cli("--config", str(cfg), "volume", "rm", "ckpt")  # no terminal: not asked, refused
    assert r.code == 2 and "--yes" in r.err
    assert json.loads(cli("--config", str(cfg), "volume", "ls", "-o", "json").out)["volumes"]
    r = cli("--config", str(cfg), "volume", "rm", "ckpt", "--yes")
    assert r.code == 0 and "deleted volume ckpt" in r.out
    assert json.loads(cli("--config", str(cfg), "volume", "ls", "-o", "json").out) == {
        "volumes": []
    }
    assert cli("--config", str(cfg), "volume", "rm", "ckpt", "--yes").code == 2  # gone


def _cli_now():
    from tests.conftest import TEST_START

    return TEST_START


def test_status_and_up_show_the_volume(cli, home, tmp_path):
    cfg = write_settings(home)
    spec = write_yaml(tmp_path / "exp.yaml", experiment().to_json())
    r = cli("--config", str(cfg), "up", str(spec), "--no-wait")
    assert r.code == 0, r.err
    assert "volume ckpt 73 GB at /data (in-use): 0.01 USD/h until" in r.out
    d = json.loads(cli("--config", str(cfg), "status", "exp", "--no-refresh", "-o", "json").out)
    (v,) = d["volumes"]
    assert (v["name"], v["path"], v["status"], v["attached_to"]) == (
        "ckpt",
        "/data",
        "in-use",
        "exp",
    )
    r = cli("--config", str(cfg), "status", "exp", "--no-refresh")
    assert "ckpt at /data: 73 GB in sandbox sandbox-us-1a, in-use (exp)" in r.out
    assert cli("--config", str(cfg), "down", "exp", "--yes").code == 0
    spec2 = write_yaml(tmp_path / "next.yaml", experiment("next").to_json())
    r = cli("--config", str(cfg), "up", str(spec2), "--no-wait", "-o", "json")
    up = json.loads(r.out)
    assert [p["message"] for p in up["pinned"]] == [
        "pinned to sandbox sandbox-us-1a by volume ckpt"
    ]
    assert [(v["name"], v["path"], v["attached_to"]) for v in up["volumes"]] == [
        ("ckpt", "/data", "next")
    ]
    r = cli("--config", str(cfg), "status", "-a", "-o", "json")
    names = sorted(m["name"] for m in json.loads(r.out))
    assert names == ["exp", "next"]  # the volume's ledger row is no machine


# --- relaunch, start, gc ------------------------------------------------------------------------


def test_a_machine_started_in_place_after_a_preemption_keeps_its_volume(app, clock):
    m = machines.up(app, experiment(lifecycle={"on_preemption": "relaunch"})).machine
    clock.advance(timedelta(hours=1))
    app.provider("sandbox").preempt(machines.ref(m))  # stopped, the volume still attached
    reconcile.run(app)
    clock.advance(timedelta(minutes=5))
    assert [(a.action, a.done) for a in recover.run(app).actions] == [("start", True)]
    again = machines.find(app, "exp")
    assert (again.id, again.status) == (m.id, "running")
    (cv,) = sandbox_volumes(app)
    assert cv["attached_to"] == m.instance_id


def test_a_relaunch_after_a_preemption_attaches_the_volume_to_the_new_machine(app, clock):
    lost = machines.up(app, experiment(lifecycle={"on_preemption": "relaunch"})).machine
    clock.advance(timedelta(hours=1))
    app.provider("sandbox").preempt(machines.ref(lost))  # stopped, the volume still attached
    reconcile.run(app)
    app.provider("sandbox").terminate(machines.ref(lost))  # … and then gone from the cloud
    assert [(a.action, a.done) for a in recover.run(app).actions] == [("relaunch", True)]
    new = machines.find(app, "exp")
    assert new.id != lost.id and new.zone == lost.zone
    (cv,) = sandbox_volumes(app)
    assert cv["attached_to"] == new.instance_id
    with app.db.session() as s:
        (v,) = volumes.live(s, "demo")
        assert v.attached_machine_id == new.id
    assert f"virtio-{cv['id']}" in user_data(app, new.instance_id or "")


def test_start_attaches_a_volume_the_machine_lost(app, clock):
    m = machines.up(app, experiment()).machine
    clock.advance(timedelta(hours=1))
    machines.stop(app, "exp")
    clock.advance(timedelta(hours=1))
    sandbox = app.provider("sandbox")
    sandbox.volumes.detach(volumes.vref(volumes.find(app, "ckpt", "demo")), machines.ref(m))
    assert sandbox_volumes(app)[0]["attached_to"] is None
    machines.start(app, "exp")
    assert sandbox_volumes(app)[0]["attached_to"] == m.instance_id


def test_gc_lists_volumes_nobody_uses_and_removes_none(app, cli, home):
    cfg = write_settings(home)
    a = App(load_settings(cfg), ManualClock(_cli_now()))
    machines.up(a, experiment())
    machines.down(a, "exp")
    stray = a.provider("sandbox").create_unmanaged_volume("lost-disk")  # type: ignore[attr-defined]
    a.close()
    r = cli("--config", str(cfg), "gc", "-o", "json")
    found = {v["id"]: v["why"] for v in json.loads(r.out)["volumes"]}
    assert found[stray] == "no state row knows it"
    (kept,) = [why for vid, why in found.items() if vid != stray]
    assert "no live machine names it" in kept and "volume rm ckpt --project demo" in kept
    r = cli("--config", str(cfg), "gc", "--terminate", "--yes")
    assert r.code == 0 and f"unused: volume sandbox/sandbox-us-1a {stray}" in r.out
    assert len(json.loads(cli("--config", str(cfg), "gc", "-o", "json").out)["volumes"]) == 2


# --- the budget ---------------------------------------------------------------------------------


def test_a_new_volume_counts_in_the_budget_until_the_period_ends(app):
    without = plan(app, experiment(vols=[]))
    with_volume = plan(app, experiment())
    assert (without.new_volume_gb, with_volume.new_volume_gb) == (0, 73)
    from provisioner.budget import candidate_cost

    c = with_volume.candidates[0]
    hours = Decimal(10)
    base = candidate_cost(app, c, 50, hours, "USD")
    more = candidate_cost(app, c, 50, hours, "USD", volume_gb=73, volume_hours=Decimal(100))
    assert more.amount - base.amount == HOURLY * 100
    machines.up(app, experiment())
    assert plan(app, experiment("other")).new_volume_gb == 0  # it exists: already billing


# --- the mount script, run ----------------------------------------------------------------------


@pytest.mark.skipif(
    not all(shutil.which(t) or os.path.exists(f"/sbin/{t}") for t in ("mkfs.ext4", "blkid")),
    reason="needs mkfs.ext4 and blkid (e2fsprogs, util-linux)",
)
def test_the_mount_script_formats_a_blank_disk_once_and_never_again(tmp_path):
    """The rendered script on a file standing in for the disk (mkfs and blkid work on files
    without root); ``mount``, ``mountpoint`` and ``chown`` are stand-ins that record what they
    are asked."""
    disk = tmp_path / "disk.img"
    disk.write_bytes(b"\0" * 8 * 1024 * 1024)
    link = tmp_path / "by-id" / "virtio-sbv-1"
    link.parent.mkdir()
    link.symlink_to(disk)
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "mount").write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/mounted\n')
    (bin_ / "mountpoint").write_text("#!/bin/sh\nexit 1\n")
    (bin_ / "chown").write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/chowned\n')
    for f in bin_.iterdir():
        f.chmod(0o755)
    fstab = tmp_path / "fstab"
    script = tmp_path / "mount.sh"
    me = subprocess.run(["id", "-un"], capture_output=True, text=True).stdout.strip()
    script.write_text(startup.mount_script([(str(link), str(tmp_path / "data"))], me))
    env = {
        **os.environ,
        "PATH": f"{bin_}:/usr/sbin:/sbin:{os.environ['PATH']}",
        "PV_FSTAB": str(fstab),
        "PV_WAIT_SECONDS": "0",
        "PV_STATE": str(tmp_path / "state"),
    }

    def run() -> str:
        r = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        blkid = subprocess.run(
            ["blkid", "-p", "-s", "UUID", "-o", "value", str(disk)],
            env=env,
            capture_output=True,
            text=True,
        )
        return blkid.stdout.strip()

    uuid = run()
    assert uuid, "no filesystem was made on the blank disk"
    assert (
        subprocess.run(
            ["blkid", "-p", "-o", "value", "-s", "TYPE", str(disk)],
            env=env,
            capture_output=True,
            text=True,
        ).stdout.strip()
        == "ext4"
    )
    assert run() == uuid  # the second boot finds the filesystem: nothing formatted over it
    assert fstab.read_text().splitlines() == [
        f"UUID={uuid} {tmp_path / 'data'} auto defaults,nofail 0 2"
    ]
    assert (tmp_path / "mounted").read_text().split("\n")[0] == f"{disk} {tmp_path / 'data'}"
    assert (tmp_path / "data").is_dir()
    # the disk it formatted went to the login user, once: a disk with data keeps its owners
    assert (tmp_path / "chowned").read_text() == f"{me}: {tmp_path / 'data'}\n"

    # a disk that never appears: said, nothing else done
    script.write_text(startup.mount_script([(str(tmp_path / "nodisk"), str(tmp_path / "d2"))]))
    r = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True)
    assert r.returncode == 0 and "did not appear" in r.stderr and not (tmp_path / "d2").exists()


def test_the_mounts_go_before_the_users_script_in_every_kind_of_startup_data():
    mounts = [("/dev/disk/by-id/virtio-x", "/data")]
    plain = startup.with_mounts("echo hi", mounts) or ""
    assert plain.startswith("#!/bin/bash\n") and plain.count("#!") == 1
    assert plain.index("pv_mount '/dev/disk/by-id/virtio-x' '/data'") < plain.index("echo hi")
    shebang = startup.with_mounts("#!/bin/sh\necho hi\n", mounts) or ""
    assert shebang.startswith("#!/bin/sh\n")
    assert shebang.index("pv_mount") < shebang.index("echo hi")
    config = startup.with_mounts("#cloud-config\nruncmd: [ls]\n", mounts) or ""
    assert config.startswith("Content-Type: multipart/mixed")
    assert config.index("pv_mount") < config.index("#cloud-config")
    alone = startup.with_mounts(None, mounts) or ""
    assert alone.startswith("#!/bin/bash\n") and "pv_mount" in alone
    assert startup.with_mounts("echo hi", []) == "echo hi"
    for text in (plain, shebang, alone):
        assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0


# --- the sandbox's rules, and a crash at each step ----------------------------------------------


def test_the_sandbox_attaches_in_one_zone_to_one_machine_and_keeps_volumes_past_terminate(app):
    from providers.base import InvalidRequest, LaunchRequest, VolumeRequest

    sandbox = app.provider("sandbox")

    def launch(zone: str, token: str):
        return sandbox.launch(
            LaunchRequest(
                name=token,
                token=token,
                region="sandbox-us",
                zone=zone,
                instance_type="sbx-t4-1",
                gpu="T4",
                gpu_count=1,
                spot=False,
                labels={"managed-by": "provisioner"},
            )
        )

    a, b, far = (
        launch("sandbox-us-1a", "a"),
        launch("sandbox-us-1a", "b"),
        launch("sandbox-us-1b", "c"),
    )
    req = VolumeRequest(
        "v", "tok", "sandbox-us", "sandbox-us-1a", 10, {"managed-by": "provisioner"}
    )
    vol = sandbox.volumes.create(req)
    assert sandbox.volumes.create(req).id == vol.id  # the same token: the same volume
    with pytest.raises(InvalidRequest, match="same zone"):
        sandbox.volumes.attach(vol.ref, far.ref, 0)
    sandbox.volumes.attach(vol.ref, a.ref, 0)
    sandbox.volumes.attach(vol.ref, a.ref, 0)  # again: nothing to do
    with pytest.raises(InvalidRequest, match="attached to"):
        sandbox.volumes.attach(vol.ref, b.ref, 0)
    with pytest.raises(InvalidRequest, match="attached to"):
        sandbox.volumes.delete(vol.ref)
    sandbox.stop(a.ref)
    assert sandbox.volumes.get(vol.ref).attached_to == a.id  # a stop keeps it attached
    sandbox.terminate(a.ref)
    kept = sandbox.volumes.get(vol.ref)
    assert (kept.state.value, kept.attached_to) == ("available", None)
    sandbox.volumes.attach(vol.ref, b.ref, 0)
    sandbox.volumes.detach(vol.ref, b.ref)
    sandbox.volumes.delete(vol.ref)
    sandbox.volumes.delete(vol.ref)  # gone already: no error
    assert [v.id for v in sandbox.volumes.ours()] == []


@pytest.mark.slow
@pytest.mark.parametrize(
    "point", ["before-volume-create", "after-volume-create", "before-launch", "after-launch"]
)
def test_up_killed_at_each_step_converges_on_one_volume(home, tmp_path, point):
    from tests.conftest import run_cli

    cfg = write_settings(home)
    spec = write_yaml(tmp_path / "exp.yaml", experiment().to_json())
    first = run_cli(
        "--config", str(cfg), "up", str(spec), "--no-wait", env={"PROVISIONER_CRASH_AT": point}
    )
    assert first.returncode == -9, first.stderr
    again = run_cli("--config", str(cfg), "up", str(spec), "--no-wait")
    assert again.returncode == 0, again.stderr
    a = App(load_settings(cfg), ManualClock(_cli_now()))
    try:
        m = machines.find(a, "exp")
        (cv,) = sandbox_volumes(a)
        assert cv["attached_to"] == m.instance_id
        with a.db.session() as s:
            (v,) = volumes.live(s, "demo")
            open_ = [
                iv
                for iv in s.scalars(select(UsageInterval).where(UsageInterval.machine_id == v.id))
                if iv.ended_at is None
            ]
        assert (v.volume_id, v.status, len(open_)) == (cv["id"], "in-use", 1)
    finally:
        a.close()


def test_a_cloud_without_volumes_is_no_candidate_for_an_experiment_with_one(app, monkeypatch):
    from providers.base import Provider
    from providers.sandbox.adapter import SandboxProvider

    # an adapter without a volume service: the base's ``volumes``, None
    monkeypatch.setattr(SandboxProvider, "volumes", Provider.volumes)
    p = plan(app, experiment())
    why = "no volumes on sandbox: its adapter has no volume service"
    assert p.candidates == [] and p.rejected[why] > 0
    assert plan(app, experiment(vols=[])).candidates  # without volumes it still plans
    assert app.provider("sandbox").volumes is None


def test_up_is_refused_when_a_new_volume_would_overrun_the_budget(home, clock, tmp_path, db_url):
    from tests.conftest import make_settings

    pdir = tmp_path / "policies"
    pdir.mkdir()
    write_yaml(
        pdir / "b.yaml",
        {
            "name": "demo-budget",
            "applies_to": {"projects": ["demo"]},
            "budget": {"amount": "50 USD"},
        },
    )
    a = App(make_settings(home, state_url=db_url, policies=[str(pdir)]), clock)
    try:
        big = {"name": "ckpt", "size_gb": 730, "path": "/data"}  # 0.10 USD an hour
        ten_hours = {"lifecycle": {"max_lifetime": "10h"}}
        # the machine's 10 hours fit; the volume bills on to the month's end (687 h): 68.70 USD
        with pytest.raises(UserError, match=r"would cost 70\.27 USD over 10\.0 h"):
            machines.up(a, experiment(vols=[big], **ten_hours))
        assert machines.up(a, experiment(vols=[], **ten_hours)).machine.status == "running"
    finally:
        a.close()


def test_a_volume_the_cloud_shows_on_a_terminated_machine_is_detached_first(app, clock):
    """A cloud that detaches after the terminate (EBS: 'detaching') still shows the old
    attachment when the relaunch attaches: the old machine is ours and gone, so it is detached."""
    lost = machines.up(app, experiment()).machine
    sandbox = app.provider("sandbox")
    clock.advance(timedelta(hours=1))
    machines.down(app, "exp")
    vol = volumes.find(app, "ckpt", "demo")
    with sandbox._db() as db:  # type: ignore[attr-defined]  # as the cloud still reports it
        db.execute(
            "UPDATE volumes SET state = 'in-use', attached_to = ? WHERE id = ?",
            (lost.instance_id, vol.volume_id),
        )
    clock.advance(timedelta(minutes=5))
    new = machines.up(app, experiment()).machine
    assert sandbox_volumes(app)[0]["attached_to"] == new.instance_id
    with sandbox._db() as db:  # type: ignore[attr-defined]  # now a stranger's instance
        db.execute("UPDATE volumes SET attached_to = 'i-foreign' WHERE id = ?", (vol.volume_id,))
    with pytest.raises(OperationFailed, match="i-foreign, which no machine of provisioner is"):
        machines.start(app, "exp")


def test_a_volume_deleted_outside_provisioner_is_said_and_forgotten_by_volume_rm(app, clock):
    machines.up(app, experiment())
    clock.advance(timedelta(hours=1))
    machines.down(app, "exp")
    sandbox = app.provider("sandbox")
    sandbox.volumes.delete(volumes.vref(volumes.find(app, "ckpt", "demo")))  # from its console
    with pytest.raises(OperationFailed, match="is gone from sandbox, deleted outside"):
        machines.up(app, experiment("again"))
    machines.down(app, "again")  # the intent the refusal left
    volumes.remove(app, volumes.find(app, "ckpt", "demo"))
    assert machines.up(app, experiment("again")).machine.status == "running"
    assert len(sandbox_volumes(app)) == 1


def test_volume_rm_on_a_terminal_asks_and_a_no_keeps_it(cli, home, monkeypatch):
    import io
    import sys

    cfg = write_settings(home)
    a = App(load_settings(cfg), ManualClock(_cli_now()))
    machines.up(a, experiment())
    machines.down(a, "exp")
    a.close()
    for answer, code, left in (("n\n", 1, 1), ("y\n", 0, 0)):
        stdin = io.StringIO(answer)
        stdin.isatty = lambda: True  # type: ignore[method-assign]
        monkeypatch.setattr(sys, "stdin", stdin)
        r = cli("--config", str(cfg), "volume", "rm", "ckpt")
        assert r.code == code, r.err
        assert "delete volume ckpt of project demo (73 GB in sandbox sandbox-us-1a)" in r.err
        ls = json.loads(cli("--config", str(cfg), "volume", "ls", "-o", "json").out)
        assert len(ls["volumes"]) == left
