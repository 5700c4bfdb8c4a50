"""`provisioner gc`: machines with our tag that the state does not know are found and removed."""

from __future__ import annotations

import json

from providers.base import TAG_MACHINE, TAG_MANAGED_BY, InstanceRef, LaunchRequest
from provisioner.app import App
from tests.conftest import EXAMPLES, make_settings, run_cli, write_settings


def stray(app: App, name: str, machine_id: str) -> str:
    req = LaunchRequest(
        name=name,
        token=f"tok-{name}",
        region="sandbox-us",
        zone="sandbox-us-1b",
        instance_type="sbx-t4-1",
        gpu="T4",
        gpu_count=1,
        spot=False,
        labels={TAG_MANAGED_BY: "provisioner", TAG_MACHINE: machine_id},
    )
    return app.provider("sandbox").launch(req).id


def test_gc_finds_and_terminates_orphans_only(home, db_url):
    cfg = write_settings(home, state_url=db_url)
    assert run_cli("--config", str(cfg), "up", str(EXAMPLES / "quickstart.yaml")).returncode == 0
    app = App(make_settings(home, state_url=db_url))
    sandbox = app.provider("sandbox")
    lost = stray(app, "lost", "0" * 32)  # ours by tag, unknown to the state
    sandbox.create_unmanaged("someone-elses")
    app.close()

    listed = run_cli("--config", str(cfg), "gc", "-o", "json")
    assert listed.returncode == 0, listed.stderr
    report = json.loads(listed.stdout)
    assert [o["id"] for o in report["orphans"]] == [lost]
    assert report["terminated"] == [] and "aws" not in report["not_asked"]  # only enabled clouds

    refused = run_cli("--config", str(cfg), "gc", "--terminate")  # no terminal: no confirmation
    assert refused.returncode != 0
    assert sandbox.get(InstanceRef(id=lost, region="sandbox-us")).state.value == "running"

    done = run_cli("--config", str(cfg), "gc", "--terminate", "--yes")
    assert done.returncode == 0 and "terminated" in done.stdout and lost in done.stdout
    assert (
        sandbox.get(type(sandbox.list_managed()[0].ref)(id=lost, region="sandbox-us")).state.value
        == "terminated"
    )
    again = json.loads(run_cli("--config", str(cfg), "gc", "-o", "json").stdout)
    assert again["orphans"] == []
    status = json.loads(run_cli("--config", str(cfg), "status", "-o", "json").stdout)
    # the known machine is untouched (stopped by its own run's on_finish, not terminated)
    assert [m["status"] for m in status] == ["stopped"]
