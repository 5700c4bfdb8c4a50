"""What every step of a machine's life shares: finding it by name, recording an event or a
transition (which the ledger prices), and one call to its cloud with the error said plainly."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import providers
from providers.base import InstanceRef, NotFound, ProviderError
from provisioner import catalog, ledger, permits, team_sql
from provisioner.app import App
from provisioner.crashpoints import crashpoint
from provisioner.errors import OperationFailed, UserError
from provisioner.models import Event, EventKind, Machine, MachineStatus
from provisioner.state import live_machine
from provisioner.state import machine as machine_row


def find(app: App, name: str) -> Machine:
    with app.db.session() as s:
        m = live_machine(s, name)
    if m is None:
        raise UserError(f"no machine named {name!r} (see `provisioner status`)")
    return m


def find_to_act(app: App, name: str) -> Machine:
    """The live machine ``name``, once who acts may act on it (else :class:`NotOwner`,
    exit 2: :mod:`provisioner.permits`)."""
    m = find(app, name)
    permits.check(app, m, m.name)
    return m


def ref(m: Machine) -> InstanceRef:
    return InstanceRef(
        id=m.instance_id or "", region=m.region or "", zone=m.zone or "", name=m.resource_name or ""
    )


def can_stop(m: Machine) -> bool:
    """Whether ``m``'s cloud can stop it and start it again (not an AWS one-time spot)."""
    return (
        m.market != "spot"
        or m.cloud not in providers.REGISTRY
        or (providers.spec(m.cloud).capabilities.stop_spot)
    )


def record_event(
    app: App,
    machine_id: str,
    kind: EventKind,
    *,
    reason: str | None = None,
    detail: dict[str, Any] | None = None,
) -> None:
    with app.db.session() as s:
        s.add(
            Event(
                machine_id=machine_id,
                at=app.clock.now(),
                kind=kind,
                reason=reason,
                detail=detail or {},
            )
        )


def transition(app: App, machine_id: str, status: MachineStatus, **kw: Any) -> tuple[Machine, bool]:
    """Move the machine to ``status`` now (an event, usage opened or closed): (machine,
    changed)."""
    with app.db.session() as s:
        m = machine_row(s, machine_id)
        changed = ledger.record_transition(s, m, status, app.clock.now(), **kw)
        return m, changed


def require_launched(m: Machine) -> None:
    if m.status == MachineStatus.WAITING:
        raise UserError(
            f"{m.name} is waiting for capacity (nothing is launched; see `provisioner status "
            f"{m.name}`); `provisioner down {m.name}` cancels it"
        )
    if m.status == MachineStatus.REQUESTED or not m.instance_id:
        raise UserError(
            f"{m.name} is still being launched; run `provisioner up` again to finish, or `down` it"
        )


def provider_call(app: App, m: Machine, op: str) -> None:
    """``op`` (stop, start, terminate) on ``m``'s cloud; a machine the cloud no longer has is
    terminated already, and any other failure is an :class:`OperationFailed` naming it. The
    team's state is asked first whether this role may act on ``m`` (refused: exit 2)."""
    team_sql.require_may_act(app.db, [m.id])
    try:
        getattr(app.provider(m.cloud or ""), op)(ref(m))
    except NotFound:
        if op != "terminate":
            raise OperationFailed(f"{m.name}: the cloud no longer has {m.instance_id}") from None
    except ProviderError as e:
        raise OperationFailed(f"{m.name}: {op} failed: {e}") from None
    crashpoint(f"after-{op}")  # the cloud acted, the state does not know yet


def address_rate(app: App, cloud: str, currency: str) -> tuple[Decimal | None, str]:
    """Its public IPv4 address per hour, fixed at launch like the compute rate, and while it
    bills (:data:`provisioner.schema.ADDRESS_BILLED`): :func:`provisioner.catalog.address_rate`."""
    return catalog.address_rate(app.settings, cloud, currency)


def set_rates(app: App, m: Machine, cloud: str, currency: str) -> None:
    """A machine's disk and address rates, for ``cloud`` in ``currency`` (its compute rate's)."""
    m.disk_rate = disk_rate(app, cloud, currency, m.disk_gb or 0)
    m.address_rate, m.address_billed = address_rate(app, cloud, currency)


def disk_rate(app: App, cloud: str, currency: str, disk_gb: int) -> Decimal | None:
    """Per hour, fixed at launch like the compute rate. None when the price is unknown."""
    per_gb_month, hours, _ = catalog.disk_price(app.settings, cloud, currency)
    if per_gb_month is None:
        return None
    return per_gb_month * disk_gb / hours
