"""Every billed piece in the ledger: a machine's public IPv4 address priced from the launch (rate
fixed then, in the machine's currency) and counted while its cloud bills it — released at stop
(``running``: AWS's auto-assigned address) or kept by a stopped machine until it is deleted
(``held``: an Azure static address, a SberCloud EIP)."""

from __future__ import annotations

import json
from datetime import timedelta
from decimal import Decimal

import pytest

from provisioner import catalog, ledger, machines
from provisioner.app import App
from provisioner.clock import CLOCK_ENV
from provisioner.spec import Experiment
from tests.conftest import TEST_START, make_settings, sandbox_experiment, write_settings, write_yaml

pytest_plugins = ["tests.cli_runner"]  # the `cli` fixture

IPV4 = Decimal("0.005")  # USD per address-hour, set for the sandbox as AWS charges it
H = timedelta(hours=1)


def by_kind(app: App, name: str) -> dict[str, Decimal]:
    """What the machine ``name`` has cost per kind of usage, in USD, since the test began."""
    with app.db.session() as s:
        sums = ledger.spend_by(s, TEST_START, app.clock.now(), ("machine", "kind"))
    return {k[1]: v["USD"] for k, v in sums.items() if k[0] == name}  # type: ignore[index]


def test_shipped_address_prices_cite_their_source_and_say_when_they_bill():
    s = make_settings_nowhere()
    aws = catalog.address_price(s, "aws", "USD")
    assert (aws.rate, aws.billed) == (Decimal("0.005"), "running")
    assert "2024-02-01" in aws.source
    azure = catalog.address_price(s, "azure", "USD")
    assert (azure.rate, azure.billed) == (Decimal("0.005"), "held")
    sber = catalog.address_price(s, "sbercloud", "RUB")
    assert (sber.rate, sber.billed) == (None, "held")  # billed, at a rate not published here
    assert "bandwidth is not counted" in sber.source
    assert catalog.address_price(s, "aws", "RUB").rate is None  # no row in that currency


def make_settings_nowhere():
    from pathlib import Path

    return make_settings(Path("/nonexistent-home"))


def test_an_address_released_at_stop_bills_only_while_the_machine_runs(home, clock, db_url):
    app = App(make_settings(home, state_url=db_url, address_prices={"sandbox": IPV4}), clock)
    try:
        m = machines.up(app, Experiment.model_validate(sandbox_experiment("ip"))).machine
        assert (m.address_rate, m.address_billed) == (IPV4, "running")
        clock.advance(10 * H)
        machines.stop(app, "ip")
        clock.advance(10 * H)  # stopped: the address was given back, the disk stays
        machines.start(app, "ip")
        clock.advance(10 * H)
        machines.down(app, "ip")
        clock.advance(5 * H)  # down: nothing bills any more
        spent = by_kind(app, "ip")
    finally:
        app.close()
    assert spent["address"] == 20 * IPV4 == Decimal("0.1")
    assert spent["compute"] == 20 * m.rate
    disk = m.disk_rate
    assert disk is not None and spent["disk"] == 30 * disk
    assert set(spent) == {"compute", "disk", "address"}


def test_a_batch_stop_and_down_close_the_addresses_too(home, clock, db_url):
    """The sweep stops and takes down many machines in one batch (``record_transitions``)."""
    app = App(make_settings(home, state_url=db_url, address_prices={"sandbox": IPV4}), clock)
    try:
        for name in ("ma", "mb"):
            machines.up(app, Experiment.model_validate(sandbox_experiment(name)))
        clock.advance(3 * H)
        machines.stop_many(app, ["ma", "mb"], reason="idle")
        clock.advance(4 * H)
        machines.down_many(app, ["ma", "mb"])
        clock.advance(2 * H)
        spent = [by_kind(app, name)["address"] for name in ("ma", "mb")]
    finally:
        app.close()
    assert spent == [3 * IPV4, 3 * IPV4]


def test_a_rate_changed_after_launch_does_not_change_what_a_machine_pays(home, clock, db_url):
    app = App(make_settings(home, state_url=db_url, address_prices={"sandbox": IPV4}), clock)
    try:
        machines.up(app, Experiment.model_validate(sandbox_experiment("ip")))
    finally:
        app.close()
    clock.advance(4 * H)
    dearer = make_settings(home, state_url=db_url, address_prices={"sandbox": Decimal("1")})
    app = App(dearer, clock)
    try:
        assert by_kind(app, "ip")["address"] == 4 * IPV4  # the rate fixed at launch
    finally:
        app.close()


def test_without_an_address_price_nothing_is_counted_for_it(app):
    machines.up(app, Experiment.model_validate(sandbox_experiment("ip")))
    app.clock.advance(3 * H)  # type: ignore[attr-defined]
    assert "address" not in by_kind(app, "ip")


def test_up_status_plan_and_report_show_the_address(cli, home, tmp_path, monkeypatch):
    cfg = write_settings(home, address_prices={"sandbox": "0.005"})
    spec = write_yaml(tmp_path / "ip.yaml", sandbox_experiment("ip"))
    r = cli("--config", str(cfg), "plan", str(spec))
    assert r.code == 0, r.err
    assert "public IPv4: sandbox + 0.005 USD/h, while it runs" in r.out
    r = cli("--config", str(cfg), "plan", str(spec), "-o", "json")
    assert "sandbox + 0.005 USD/h, while it runs" in json.loads(r.out)["addresses"]
    r = cli("--config", str(cfg), "up", str(spec), "--no-wait")
    assert r.code == 0, r.err
    assert "public IPv4: 0.005 USD/h while it runs" in " ".join(r.out.split())
    r = cli("--config", str(cfg), "status", "ip", "--no-refresh")
    assert "0.005 USD/h public IPv4" in " ".join(r.out.split())
    monkeypatch.setenv(CLOCK_ENV, (TEST_START + 10 * H).isoformat())
    assert cli("--config", str(cfg), "down", "ip", "--yes").code == 0
    r = cli("--config", str(cfg), "report", "--period", "2026-11", "--by", "machine", "-o", "json")
    assert r.code == 0, r.err
    report = json.loads(r.out)
    assert report["by_kind"]["address"]["amount"] == "0.05"  # 10 h at 0.005
    r = cli("--config", str(cfg), "report", "--period", "2026-11", "--by", "machine")
    assert r.code == 0, r.err
    assert "Public IPv4" in r.out  # its own column beside compute and disks
    r = cli("--config", str(cfg), "report", "--period", "2026-11", "--language", "ru")
    assert r.code == 0 and "Публичные IPv4" in r.out, r.err


# --- a SberCloud EIP: kept by a stopped server, deleted by `down` ------------------------------


@pytest.fixture
def sber(monkeypatch):
    from tests.contract.sbercloud import AK, SK, sber_env
    from tests.emulators.sbercloud import EcsEmulator

    sber_env(monkeypatch)
    e = EcsEmulator(AK, SK).start()
    yield e
    e.stop()


def test_an_idle_stopped_sbercloud_server_keeps_its_eip_billing_until_down(sber, home, clock):
    from tests.contract.sbercloud import options

    eip = Decimal("0.55")  # RUB per hour: cloud.ru publishes none here, so set as a user would
    settings = make_settings(
        home,
        clouds={"sbercloud": options(sber)},
        prices={"sbercloud": {"pi2.2xlarge.4": {"price": "95", "spot_price": "30"}}},
        address_prices={"sbercloud": eip},
    )
    e = sandbox_experiment("train", clouds=["sbercloud"], market="reserved")
    app = App(settings, clock)
    try:
        m = machines.up(app, Experiment.model_validate(e)).machine
        assert (m.address_rate, m.address_billed, m.currency) == (eip, "held", "RUB")
        clock.advance(2 * H)
        machines.stop(app, "train", reason="idle")
        [kept] = sber.eips.values()  # stopped, the server keeps its EIP: it bills
        assert kept["server_id"] == m.instance_id
        clock.advance(10 * H)
        machines.down(app, "train")
        assert sber.eips == {}  # deleted with the server: nothing bills
        clock.advance(5 * H)
        with app.db.session() as s:
            sums = ledger.spend_by(s, TEST_START, clock.now(), ("kind",))
    finally:
        app.close()
    assert sums[("address",)]["RUB"] == 12 * eip  # 2 h running + 10 h stopped
    assert sums[("compute",)]["RUB"] == 2 * Decimal("95")
