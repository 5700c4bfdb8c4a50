"""What ``up`` shows: each step as it goes, the machine launched and what to do with it next,
a name that exists, the followed run's end — rendered from :mod:`provisioner.workflows.up`'s
events and outcomes, as text or JSON."""

from __future__ import annotations

import sys
from typing import Any

import typer

from provisioner.cli import Output, err, out, print_json
from provisioner.fleet import machine_json
from provisioner.fleet import money_text as _money
from provisioner.schema import MachineStatus as S
from provisioner.workflows import up as flow


class Shown:
    """What ``up`` shows as it goes: each step as a spinner, notes on stderr, the machine once
    launched, the run's output."""

    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet
        self.status: Any = None  # rich's Status while a step lasts

    def __call__(self, e: flow.Event) -> None:
        if isinstance(e, flow.Warned):
            err.print(f"warning: {e.text}", highlight=False, markup=False, soft_wrap=True)
        elif self.quiet:
            return
        elif isinstance(e, flow.Stage):
            self.stop()
            what = "launching" if e.step == "launching" else "waiting for"
            self.status = err.status(f"{what} {e.name}…")
            self.status.start()
        elif isinstance(e, flow.Note):
            err.print(e.text, highlight=False, soft_wrap=True)
        elif isinstance(e, flow.Launched):
            self.stop()
            _launched_lines(e.launch)
        elif isinstance(e, flow.RunResumed):
            self.stop()
            out.print(f"{e.name} was launched before; its run had not started: started now")
        elif isinstance(e, flow.Following):
            out.print(
                f"  job run (on_finish: {e.on_finish}); its output follows "
                f"(Ctrl-C leaves it running: `provisioner logs {e.name} -f`)",
                soft_wrap=True,
            )
        elif isinstance(e, flow.RunOutput):
            sys.stdout.buffer.write(e.chunk)
            sys.stdout.flush()

    def stop(self) -> None:
        if self.status is not None:
            self.status.stop()
            self.status = None


def outcome(result: flow.Outcome, path: str, output: Output) -> None:
    """How ``up`` ended: a name that exists, a followed run's end (exit 1 when it failed), or
    the machine launched (as JSON, or what to do with it next)."""
    if isinstance(result, flow.Already):
        _already(result, path, output)
    elif isinstance(result, flow.RunEnded):
        out.print(_run_end(result), highlight=False, soft_wrap=True)
        if result.failed:
            raise typer.Exit(1)
    elif output is Output.json:
        print_json({"already": False, **_launch_json(result)})
    else:
        _hints(result)


def _launch_json(launch: flow.Launch) -> dict[str, Any]:
    m = launch.machine
    shown = {"machine": machine_json(m), "attempts": [a.to_json() for a in launch.attempts]}
    if launch.volumes is None:
        return shown
    return {
        **shown,
        "volumes": [{**v.listed.as_json(), "path": v.path} for v in launch.volumes],
        "pinned": [p.as_json() for p in launch.pins],
    }


def _launched_lines(launch: flow.Launch) -> None:
    """The machine launched: where, its rates, its volumes, its instance."""
    m = launch.machine
    out.print(
        f"[green]launched[/] {m.name} on {m.cloud} {m.zone or m.region}: {m.instance_type} "
        f"({m.gpu_count}×{m.gpu}, {m.market}) at {_money(m.rate, m.currency)}/h",
        soft_wrap=True,
    )
    if m.disk_rate is not None:
        out.print(
            f"  disk {m.disk_gb} GB: {_money(m.disk_rate, m.currency)}/h while it exists",
            soft_wrap=True,
        )
    if m.address_rate is not None:
        out.print(
            f"  public IPv4: {m.address_rate.normalize():f} {m.currency}/h "
            + ("while it runs" if m.address_billed == "running" else "until it is deleted"),
            soft_wrap=True,
        )
    _volume_lines(launch)
    out.print(
        f"  instance {m.instance_id}" + (f", address {m.public_ip}" if m.public_ip else ""),
        soft_wrap=True,
    )


def _hints(launch: flow.Launch) -> None:
    """What to do with the machine now: its job, connecting, who enforces its rules, how to
    stop or remove it."""
    m = launch.machine
    if launch.run and not launch.run_started:
        out.print(
            f"  job run starts once {m.name} answers SSH (the scheduler's reconcile pass starts "
            f"it; `provisioner logs {m.name} -f` then)",
            soft_wrap=True,
        )
    if launch.run:
        out.print(f"  job run started: `provisioner logs {m.name} -f`", soft_wrap=True)
    out.print(f"  connect with `provisioner ssh {m.name}`", soft_wrap=True)
    for line in launch.guard:
        out.print(f"  enforced by: {line}", highlight=False, soft_wrap=True)
    if not launch.can_stop:
        from provisioner.jobs.sweep import UNSTOPPABLE_WARN_MINUTES

        out.print(
            f"  a spot machine on {m.cloud} cannot be stopped: an out-of-hours idle stop "
            f"terminates it and its boot disk, not its volumes (the owner is warned "
            f"{UNSTOPPABLE_WARN_MINUTES} "
            f"minutes before); remove it with `provisioner down {m.name}`",
            soft_wrap=True,
        )
        return
    out.print(
        f"  stop it with `provisioner stop {m.name}`, remove it with `provisioner down {m.name}`",
        soft_wrap=True,
    )


def _run_end(ended: flow.RunEnded) -> str:
    """What `up` says when the followed run ended: the exit code and what on_finish did."""
    name, job, status = ended.name, ended.job, ended.status
    if job is None:
        return f"{name}: its job is gone"
    if job.exit_code is None and job.reason != "cancelled":
        return f"run was killed: {name} is {status}"
    if status == S.STOPPED:
        return (
            f"{job.said}: {name} stopped, compute billing ended "
            f"(its disk bills until `provisioner down {name}`)"
        )
    if status == S.TERMINATED:
        return f"{job.said}: {name} terminated, billing ended"
    return f"{job.said}: {name} is {status} (on_finish: keep)"


def _volume_lines(launch: flow.Launch) -> None:
    """Each volume: where it is mounted, its size and rate; the pin, when one chose the zone."""
    from provisioner.machines.volumes import rate_text

    for pin in launch.pins:
        out.print(f"  {pin}", highlight=False, soft_wrap=True)
    for v in launch.volumes or []:
        vol = v.listed.volume
        out.print(
            f"  volume {vol.name} {vol.size_gb} GB at {v.path} ({v.listed.status}): "
            f"{rate_text(vol)} until `provisioner volume rm {vol.name}`",
            highlight=False,
            soft_wrap=True,
        )


def _already(already: flow.Already, path: str, output: Output) -> None:
    """``up`` of a name that exists: nothing launched. The same spec is no error (say how to
    use it); a changed one is (exit 2), with what differs and what to run."""
    m, diffs = already.machine, already.differences
    where = "waiting for capacity" if m.status == S.WAITING else f"{m.status} on {m.cloud or '—'}"
    if output is Output.json:
        print_json({"already": True, "machine": machine_json(m), "differences": diffs})
    elif diffs:
        err.print(
            f"[red]error:[/] {m.name} already exists ({where}) from a different spec; "
            f"nothing launched. What differs (recorded → {path}):",
            highlight=False,
            soft_wrap=True,
        )
        for d in diffs:
            err.print(f"  {d}", highlight=False, markup=False, soft_wrap=True)
        err.print(
            f"To launch the new spec: `provisioner down {m.name}` then `provisioner up {path}`"
            + (
                f" (or `provisioner start {m.name}` to use the old one)"
                if m.status == S.STOPPED
                else ""
            ),
            highlight=False,
            markup=False,
            soft_wrap=True,
        )
    else:
        hint = (
            f"start it with `provisioner start {m.name}`"
            if m.status == S.STOPPED
            else f"follow it with `provisioner up {path} --retry-until-up`, or cancel it with "
            f"`provisioner down {m.name}`"
            if m.status == S.WAITING
            else f"see `provisioner status {m.name}`"
        )
        out.print(
            f"{m.name} already exists ({where}); nothing launched — {hint}",
            highlight=False,
            soft_wrap=True,
        )
    if diffs:
        raise typer.Exit(2)
