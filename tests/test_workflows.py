"""The workflows are called without the CLI (issue #36, point 1): `up` reports each step as a
typed event and ends with a typed outcome a dashboard or an API can render in its own words; the
actions on many machines ask once and report each machine as it goes; the fleet page's query is
one object, checked once."""

from __future__ import annotations

import pytest

from provisioner.errors import UserError
from provisioner.spec import Experiment
from provisioner.views.fleet import FleetQuery
from provisioner.workflows import many
from provisioner.workflows import up as flow
from tests.conftest import sandbox_experiment


def _experiment(name: str, **fields: object) -> Experiment:
    return Experiment.model_validate({**sandbox_experiment(name), **fields})


def test_up_reports_its_steps_then_follows_the_run_to_its_end(app):
    seen: list[flow.Event] = []
    request = flow.UpRequest(_experiment("job", run="echo hello from the job"), "job.yaml")
    ended = flow.up(app, request, seen.append)

    assert isinstance(ended, flow.RunEnded) and not ended.failed
    assert ended.status == "stopped"  # on_finish: a run's machine stops with it
    assert seen[0] == flow.Stage("launching", "job")
    kinds = [type(e) for e in seen]
    assert kinds.index(flow.Launched) < kinds.index(flow.Following) < kinds.index(flow.RunOutput)
    launched = next(e.launch for e in seen if isinstance(e, flow.Launched))
    assert launched.machine.name == "job" and launched.run_started and launched.attempts
    assert b"".join(e.chunk for e in seen if isinstance(e, flow.RunOutput)) == (
        b"hello from the job\n"
    )

    again = flow.up(app, request)  # the same spec again: nothing launched, no difference
    assert isinstance(again, flow.Already) and again.differences == []
    changed = flow.UpRequest(_experiment("job", run="echo another"), "job.yaml")
    assert flow.up(app, changed).differences == ["run: echo hello from the job → echo another"]


def test_up_without_following_returns_the_launch_to_render(app):
    request = flow.UpRequest(_experiment("box"), "box.yaml", wait=False, follow=False)
    launch = flow.up(app, request)
    assert isinstance(launch, flow.Launch)
    assert launch.machine.status in ("pending", "running") and not launch.run
    assert launch.volumes is None and launch.pins == []  # its experiment names no volume


def test_many_asks_once_then_reports_each_machine_as_it_goes(app):
    for name in ("gpu-a", "gpu-b"):
        flow.up(app, flow.UpRequest(_experiment(name), f"{name}.yaml", follow=False))

    def refuse(names: list[str]) -> None:
        raise UserError(f"not confirmed: {names}")

    every = many.ManyRequest("stop", project="demo")
    with pytest.raises(UserError, match=r"not confirmed: \['gpu-a', 'gpu-b'\]"):
        many.act(app, every, confirm=refuse)
    reported: list[many.Acted | many.Failed] = []
    done = many.act(app, every, progress=reported.append)
    assert [(r.name, r.changed) for r in reported] == [("gpu-a", True), ("gpu-b", True)]
    assert done.results == reported and done.exit_code == 0

    mixed = many.act(app, many.ManyRequest("down", ["gpu-a", "nobody"]))
    assert [type(r) for r in mixed.results] == [many.Acted, many.Failed]
    assert mixed.exit_code == 1  # one of two failed
    assert many.act(app, many.ManyRequest("start", ["nobody"])).exit_code == 2  # all: theirs


def test_the_fleet_query_is_checked_once_from_the_page_query_string():
    q = FleetQuery.parse({"sort": "cost", "dir": "desc", "page": "3", "project": "demo"})
    assert (q.sort, q.desc, q.page, dict(q.filters)) == ("cost", True, 3, {"project": "demo"})
    for bad, said in (
        ({"sort": "price"}, "sort 'price': one of name"),
        ({"dir": "up"}, "dir 'up': asc or desc"),
        ({"page": "0"}, "page '0': a whole number from 1"),
        ({"state": "asleep"}, "state 'asleep': one of"),
    ):
        with pytest.raises(UserError, match=said):
            FleetQuery.parse(bad)
