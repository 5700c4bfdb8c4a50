"""Policy files (errors with file, line and field), pure evaluation (every violated rule named,
the strictest policy wins), and the policy decision in `plan` and `up`."""

from __future__ import annotations

import json
from decimal import Decimal
from pathlib import Path

import pytest

from policies import loader
from policies.evaluate import CandidateFacts, Decision, Request, check_candidate, evaluate
from policies.schema import Policy, matching
from provisioner import machines, planning
from provisioner.app import App
from provisioner.errors import ConfigError, UserError
from provisioner.spec import Experiment
from tests.conftest import ROOT, make_settings, run_cli, sandbox_experiment, write_settings

EXAMPLES = ROOT / "configs" / "policies"


def pol(**kw) -> Policy:
    return Policy.model_validate({"name": "p", **kw})


def req(**kw) -> Request:
    base = {"project": "nlp-bert", "owner": "ana@example.com", "gpu": "A100", "gpu_count": 1}
    return Request(**{**base, **kw})


def cand(**kw) -> CandidateFacts:
    base = {
        "cloud": "aws",
        "region": "eu-west-1",
        "gpu": "A100",
        "gpu_count": 1,
        "market": "spot",
        "price": Decimal("3"),
        "currency": "USD",
    }
    return CandidateFacts(**{**base, **kw})


# --- files -----------------------------------------------------------------------------------


def test_shipped_examples_load():
    policies = loader.load([EXAMPLES])
    by_name = {p.name: p for p in policies}
    assert set(by_name) == {"default", "nlp-research"}
    b = by_name["nlp-research"].budget
    assert (b.amount.amount, b.amount.currency, b.period, b.on_exhausted) == (
        Decimal(5000),
        "USD",
        "month",
        "block",
    )
    assert b.alerts.actual == [50, 80, 100] and b.report.cron == "0 9 * * MON"
    assert [p.name for p in matching(policies, "nlp-bert", "x")] == ["default", "nlp-research"]
    assert [p.name for p in matching(policies, "vision", "x")] == ["default"]


def test_budget_block_variants():
    p = pol(
        budget={
            "amount": {"amount": "120000", "currency": "rub"},
            "period": {"start": "2026-11-01", "end": "2026-12-15"},
            "on_exhausted": "stop",
            "language": "ru",
        }
    )
    assert p.budget.amount.currency == "RUB" and p.budget.period.end.day == 15
    assert p.budget.alerts.forecast == [100]  # defaults


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_errors_name_file_line_and_field_for_every_problem(tmp_path):
    write(
        tmp_path,
        "a.yaml",
        "name: a\n"
        "max_gpu_per_machine: 4\n"  # line 2: typo
        "budget:\n"
        "  amount: 5000\n"  # line 4: no currency
        "off_hours:\n"
        "  timezone: Europe/Moskva\n"  # line 6
        "  windows:\n"
        "    - {days: mon-fry, start: '20:00', end: '08:00'}\n",  # line 8
    )
    write(tmp_path, "b.yaml", "policies:\n  - name: b\n    idle: {action: pause}\n")
    with pytest.raises(loader.PolicyError) as e:
        loader.load([tmp_path])
    got = {(Path(p.file).name, p.line, p.field) for p in e.value.problems}
    assert got == {
        ("a.yaml", 2, "max_gpu_per_machine"),
        ("a.yaml", 4, "budget.amount"),
        ("a.yaml", 6, "off_hours.timezone"),
        ("a.yaml", 8, "off_hours.windows.0.days"),
        ("b.yaml", 3, "policies.0.idle.action"),
    }
    text = str(e.value)
    assert "a.yaml:2: max_gpu_per_machine: unknown field" in text
    assert "unknown IANA timezone 'Europe/Moskva'" in text
    assert "needs a currency" in text


def test_yaml_syntax_duplicates_and_missing_paths(tmp_path):
    write(tmp_path, "bad.yaml", "name: x\nallow: [\n")
    write(tmp_path, "dup.yaml", "name: y\nmax_machines: 1\nmax_machines: 2\n")
    write(tmp_path, "same.yaml", "name: y\n")
    with pytest.raises(loader.PolicyError) as e:
        loader.load([tmp_path, tmp_path / "nope.yaml"])
    msgs = [str(p) for p in e.value.problems]
    assert any("bad.yaml" in m and "invalid YAML" in m for m in msgs)
    assert any("dup.yaml:3: max_machines: duplicate key" in m for m in msgs)
    assert any("same.yaml:1: name: policy 'y' is also in" in m for m in msgs)
    assert any("nope.yaml: no such file" in m for m in msgs)


def test_unquoted_times_are_read_as_times(tmp_path):
    # YAML 1.1 reads 20:00 as the number 1200; the schema turns it back into 20:00
    write(
        tmp_path,
        "t.yaml",
        "name: t\noff_hours:\n  timezone: UTC\n  windows:\n    - {start: 20:00, end: 08:00}\n",
    )
    w = loader.load([tmp_path])[0].off_hours.windows[0]
    assert (w.start.hour, w.end.hour) == (20, 8)


# --- evaluation ------------------------------------------------------------------------------


def test_every_violated_rule_is_named():
    p = pol(
        allow={"gpus": ["T4"], "markets": ["reserved"], "clouds": ["gcp"]},
        max_gpus_per_machine=2,
    )
    d = evaluate(req(gpu="A100", gpu_count=8, market="spot", clouds=("aws",)), [p])
    assert not d.allowed
    assert [v.rule for v in d.violations] == [
        "allow.gpus",
        "allow.markets",
        "allow.clouds",
        "max_gpus_per_machine",
    ]
    assert "asks for 8 GPUs, at most 2" in " ".join(d.reasons)


def test_strictest_of_several_matching_policies_wins():
    loose = Policy.model_validate({"name": "loose", "max_gpus_per_machine": 8})
    tight = Policy.model_validate(
        {"name": "tight", "applies_to": {"projects": ["nlp-*"]}, "max_gpus_per_machine": 4}
    )
    other = Policy.model_validate(
        {"name": "other", "applies_to": {"owners": ["bob@*"]}, "max_gpus_per_machine": 1}
    )
    d = evaluate(req(gpu_count=6), [loose, tight, other])
    assert d.policies == ["loose", "tight"]  # "other" is for bob only
    assert [(v.policy, v.rule) for v in d.violations] == [("tight", "max_gpus_per_machine")]
    assert evaluate(req(gpu_count=4), [loose, tight, other]).allowed
    assert evaluate(req(project="vision", gpu_count=6), [loose, tight, other]).allowed


def test_max_machines_counts_machines_in_the_policy_scope():
    p = Policy.model_validate(
        {"name": "team", "applies_to": {"projects": ["nlp-*"]}, "max_machines": 2}
    )
    other = (("vision", "x"),) * 5
    assert evaluate(req(active=(("nlp-a", "x"), *other)), [p]).allowed
    d = evaluate(req(active=(("nlp-a", "x"), ("nlp-b", "y"), *other)), [p])
    assert [v.rule for v in d.violations] == ["max_machines"]


def test_candidates_checked_with_currency_conversion():
    p = pol(
        allow={"regions": ["eu-*", "ru-*"], "markets": ["spot"]},
        max_price_per_hour="250 RUB",
    )
    usd_to_rub = {("USD", "RUB"): Decimal(80)}

    def convert(amount, frm, to):
        return amount * usd_to_rub[(frm, to)]

    assert check_candidate(cand(price=Decimal("3")), [p], convert) == []  # 240 RUB
    over = check_candidate(cand(price=Decimal("3.2")), [p], convert)  # 256 RUB
    assert [v.rule for v in over] == ["max_price_per_hour"]
    far = check_candidate(cand(region="us-east-1", market="reserved"), [p], convert)
    assert [v.rule for v in far] == ["allow.regions", "allow.markets"]
    # no way to convert: refused, and said so, rather than guessed
    assert "cannot compare" in str(check_candidate(cand(currency="EUR"), [p], convert)[0])
    d = evaluate(req(), [p], [cand(), cand(region="us-east-1"), cand(price=Decimal(9))], convert)
    assert d.allowed and d.candidates_allowed == 1 and sum(d.rejected.values()) == 2
    d = evaluate(req(), [p], [cand(region="us-east-1")], convert)
    assert not d.allowed and "allow.regions: region not allowed (1 offers)" in d.reasons[0]


# --- plan and up -----------------------------------------------------------------------------


@pytest.fixture
def policy_app(home, clock, tmp_path):
    def make(text: str, **settings) -> App:
        path = write(tmp_path, "policy.yaml", text)
        return App(make_settings(home, policies=[str(path)], **settings), clock)

    return make


def experiment(name="exp", **res) -> Experiment:
    return Experiment.model_validate(sandbox_experiment(name, **res))


def test_plan_rejects_offers_per_rule_and_shows_the_decision(policy_app):
    app = policy_app("name: eu-only\nallow: {regions: ['sandbox-eu*']}\n")
    p = planning.plan(app, experiment())
    assert {c.offer.region for c in p.candidates} == {"sandbox-eu"}
    reason = "policy eu-only: allow.regions: region not allowed"
    assert p.rejected[reason] > 0 and p.examples[reason].startswith("sandbox/sandbox-")
    decision = next(c for c in p.checks if isinstance(c, Decision))
    assert decision.allowed and "allowed by eu-only" in str(decision)
    assert decision.as_json()["rejected"][0]["rule"] == "allow.regions"


def test_up_refuses_with_every_reason_and_launches_nothing(policy_app):
    app = policy_app(
        "policies:\n"
        "  - {name: small, max_gpus_per_machine: 1, allow: {markets: [reserved]}}\n"
        "  - {name: pricey, max_price_per_hour: '0.01 USD'}\n"
    )
    with pytest.raises(UserError) as e:
        machines.up(app, experiment(gpu="T4:4", market="spot"))
    text = str(e.value)
    assert "policy small: max_gpus_per_machine: asks for 4 GPUs, at most 1" in text
    assert "policy small: allow.markets: spot is not allowed" in text
    assert e.value.exit_code == 2
    assert app.provider("sandbox").list_managed() == []
    # within the rules on everything but price: every offer turned down, and why
    with pytest.raises(UserError, match=r"policy pricey: max_price_per_hour: over 0.01 USD/h"):
        machines.up(app, experiment(market="reserved"))


def test_max_machines_blocks_a_new_launch(policy_app):
    app = policy_app("name: one\nmax_machines: 1\n")
    machines.up(app, experiment("first"))
    machines.up(app, experiment("first"))  # the same machine again: not a second one
    with pytest.raises(UserError, match="max_machines: 1 machines already run"):
        machines.up(app, experiment("second"))


def test_a_bad_policy_file_stops_plan_with_its_line(policy_app):
    app = policy_app("name: x\nmax_gpus_per_machine: many\n")
    with pytest.raises(ConfigError) as e:
        planning.plan(app, experiment())
    assert e.value.problems[0].line == 2 and e.value.problems[0].field == "max_gpus_per_machine"


def test_cli_plan_and_up_show_the_policy(home, tmp_path):
    path = write(tmp_path, "p.yaml", "name: tiny\nmax_gpus_per_machine: 1\n")
    cfg = write_settings(home, policies=[str(path)])
    spec = write(tmp_path, "e.yaml", json.dumps(sandbox_experiment("big", gpu="T4:4")))
    r = run_cli("--config", str(cfg), "plan", str(spec), "--output", "json")
    assert r.returncode == 2, r.stderr  # refused, as `up` is (the plan is still shown)
    check = next(c for c in json.loads(r.stdout)["checks"] if c.get("check") == "policy")
    assert check["allowed"] is False and check["violations"][0]["policy"] == "tiny"
    r = run_cli("--config", str(cfg), "up", str(spec))
    assert r.returncode == 2
    assert "policy tiny: max_gpus_per_machine: asks for 4 GPUs, at most 1" in r.stderr
    bad = write(tmp_path, "p.yaml", "name: tiny\nmax_gpus_per_machine: 1\nidle: {for_minutes: 0}\n")
    r = run_cli("--config", str(cfg), "plan", str(spec))
    assert r.returncode == 2 and f"{bad}:3: idle.for_minutes" in r.stderr


def test_plan_refused_by_policy_exits_2_and_allowed_exits_0(home, tmp_path):
    path = write(tmp_path, "p.yaml", "name: tiny\nmax_gpus_per_machine: 1\n")
    cfg = write_settings(home, policies=[str(path)])
    spec = write(tmp_path, "e.yaml", json.dumps(sandbox_experiment("big", gpu="T4:4")))
    r = run_cli("--config", str(cfg), "plan", str(spec))
    assert r.returncode == 2, r.stderr
    assert "policy: refused — policy tiny: max_gpus_per_machine" in r.stdout
    assert "Traceback" not in r.stderr
    ok = write(tmp_path, "e1.yaml", json.dumps(sandbox_experiment("small", gpu="T4:1")))
    r = run_cli("--config", str(cfg), "plan", str(ok))
    assert r.returncode == 0 and "policy: allowed by tiny" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("word", ["off", "on", "yes", "no", "y", "n", "NO"])
def test_a_policy_named_like_a_yaml_1_1_boolean_is_a_name(tmp_path, word):
    """YAML 1.1 reads off/on/yes/no as booleans; the files are read as YAML 1.2 (true/false)."""
    from policies.loader import load

    f = write(tmp_path, "p.yaml", f"name: {word}\napplies_to: {{projects: [{word}]}}\n")
    [policy] = load([f])
    assert policy.name == word and policy.applies_to.projects == [word]
