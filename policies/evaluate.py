"""Request (+ candidates) × policies → a decision naming every violated rule.

Pure: the caller passes plain facts (what is asked, what is already running, the candidates with
their prices) and, for prices in another currency than a policy's limit, a ``convert`` function.
Every matching policy is checked, so where several match the strictest wins.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from fnmatch import fnmatchcase
from typing import Any

from policies.schema import Policy, matching

Convert = Callable[[Decimal, str, str], Decimal]  # amount, from currency, to currency


@dataclass(frozen=True)
class Request:
    project: str
    owner: str
    gpu: str  # A100, A100-80GB, H100, T4…
    gpu_count: int
    market: str = "any"  # spot | reserved | any
    clouds: tuple[str, ...] | None = None  # None: any cloud
    active: tuple[tuple[str, str], ...] = ()  # (project, owner) of every live machine
    owned: tuple[tuple[str, int], ...] = ()  # (project, GPUs) of the owner's live machines


@dataclass(frozen=True)
class CandidateFacts:
    cloud: str
    region: str
    gpu: str
    gpu_count: int
    market: str  # spot | reserved
    price: Decimal  # per hour
    currency: str


@dataclass(frozen=True)
class Violation:
    policy: str
    rule: str  # the field of the policy: allow.regions, max_machines…
    message: str

    def __str__(self) -> str:
        return f"policy {self.policy}: {self.rule}: {self.message}"


@dataclass
class Decision:
    policies: list[str]  # names of the matching policies
    violations: list[Violation] = field(default_factory=list)  # the request itself is refused
    rejected: Counter[Violation] = field(default_factory=Counter)  # candidates turned down
    candidates_allowed: int | None = None  # None: no candidates were evaluated

    @property
    def allowed(self) -> bool:
        return not self.violations and self.candidates_allowed != 0

    @property
    def reasons(self) -> list[str]:
        """Every violated rule: the request's own, and, when no candidate is left, theirs."""
        out = [str(v) for v in self.violations]
        if self.candidates_allowed == 0:
            out += [f"{v} ({n} offers)" for v, n in self.rejected.most_common()]
        return out

    def __str__(self) -> str:
        if not self.policies:
            return "policy: no policy applies"
        names = ", ".join(self.policies)
        if self.allowed:
            turned = sum(self.rejected.values())
            extra = f"; {turned} offers turned down by policy" if turned else ""
            return f"policy: allowed by {names}{extra}"
        return "policy: refused — " + "; ".join(self.reasons)

    def as_json(self) -> dict[str, Any]:
        return {
            "check": "policy",
            "policies": self.policies,
            "allowed": self.allowed,
            "violations": [v.__dict__ for v in self.violations],
            "rejected": [{**v.__dict__, "offers": n} for v, n in self.rejected.most_common()],
        }


def evaluate(
    request: Request,
    policies: Sequence[Policy],
    candidates: Sequence[CandidateFacts] = (),
    convert: Convert | None = None,
) -> Decision:
    """Check ``request`` against every policy that applies to it, then each candidate."""
    applied = matching(list(policies), request.project, request.owner)
    d = Decision([p.name for p in applied])
    for p in applied:
        d.violations += _request_violations(request, p)
    if candidates:
        allowed = 0
        for c in candidates:
            vs = check_candidate(c, applied, convert)
            if vs:
                d.rejected[vs[0]] += 1
            else:
                allowed += 1
        d.candidates_allowed = allowed
    return d


def _request_violations(r: Request, p: Policy) -> list[Violation]:
    return _allowed(r, p) + _limits(r, p) + _per_owner(r, p)


def _allowed(r: Request, p: Policy) -> list[Violation]:
    """What ``p.allow`` refuses of the request: its GPU, market or clouds."""
    out = []

    def v(rule: str, msg: str) -> None:
        out.append(Violation(p.name, rule, msg))

    a = p.allow
    if a.gpus is not None and not _any(r.gpu, a.gpus):
        v("allow.gpus", f"{r.gpu} is not allowed (allowed: {', '.join(a.gpus)})")
    if a.markets is not None and r.market != "any" and r.market not in a.markets:
        v("allow.markets", f"{r.market} is not allowed (allowed: {', '.join(a.markets)})")
    if a.clouds is not None and r.clouds and not any(_any(c, a.clouds) for c in r.clouds):
        v(
            "allow.clouds",
            f"none of {', '.join(r.clouds)} is allowed (allowed: {', '.join(a.clouds)})",
        )
    return out


def _limits(r: Request, p: Policy) -> list[Violation]:
    """``max_gpus_per_machine``, and ``max_machines``: the machines already running in the
    policy's scope."""
    out = []
    if p.max_gpus_per_machine is not None and r.gpu_count > p.max_gpus_per_machine:
        out.append(
            Violation(
                p.name,
                "max_gpus_per_machine",
                f"asks for {r.gpu_count} GPUs, at most {p.max_gpus_per_machine} per machine",
            )
        )
    if p.max_machines is None:
        return out
    running = sum(1 for proj, own in r.active if p.applies_to.matches(proj, own))
    if running + 1 > p.max_machines:
        out.append(
            Violation(
                p.name,
                "max_machines",
                f"{running} machines already run in its scope, at most {p.max_machines}",
            )
        )
    return out


def _per_owner(r: Request, p: Policy) -> list[Violation]:
    """``per_owner``: the machines and GPUs the owner already runs in the policy's scope."""
    if p.per_owner is None:
        return []
    out = []
    mine = [
        gpus for proj, gpus in r.owned if any(fnmatchcase(proj, g) for g in p.applies_to.projects)
    ]
    cap = p.per_owner.max_machines
    if cap is not None and len(mine) + 1 > cap:
        out.append(
            Violation(
                p.name,
                "per_owner.max_machines",
                f"{r.owner} already runs {len(mine)} machines in its scope, at most {cap} each",
            )
        )
    cap = p.per_owner.max_gpus
    if cap is not None and sum(mine) + r.gpu_count > cap:
        out.append(
            Violation(
                p.name,
                "per_owner.max_gpus",
                f"{r.owner} already runs {sum(mine)} GPUs in its scope and asks for "
                f"{r.gpu_count}, at most {cap} each",
            )
        )
    return out


def check_candidate(
    c: CandidateFacts, policies: Sequence[Policy], convert: Convert | None = None
) -> list[Violation]:
    """Every rule of ``policies`` (already matched to the request) that ``c`` breaks."""
    out: list[Violation] = []
    for p in policies:
        a = p.allow
        checks = (
            ("allow.clouds", a.clouds, c.cloud, "cloud"),
            ("allow.regions", a.regions, c.region, "region"),
            ("allow.gpus", a.gpus, c.gpu, "GPU type"),
            ("allow.markets", a.markets, c.market, "market"),
        )
        for rule, allowed, value, what in checks:
            if allowed is not None and not _any(value, allowed):
                out.append(Violation(p.name, rule, f"{what} not allowed"))
        if p.max_gpus_per_machine is not None and c.gpu_count > p.max_gpus_per_machine:
            out.append(
                Violation(
                    p.name, "max_gpus_per_machine", f"more than {p.max_gpus_per_machine} GPUs"
                )
            )
        if (price_violation := _over_price(p, c, convert)) is not None:
            out.append(price_violation)
    return out


def _over_price(p: Policy, c: CandidateFacts, convert: Convert | None) -> Violation | None:
    """``c``'s hourly price over ``p``'s cap (converted to the cap's currency), or not
    comparable with it."""
    cap = p.max_price_per_hour
    if cap is None:
        return None
    price = c.price
    if c.currency != cap.currency:
        try:
            if convert is None:
                raise ValueError
            price = convert(c.price, c.currency, cap.currency)
        except (ValueError, KeyError):
            return Violation(
                p.name, "max_price_per_hour", f"cannot compare a {c.currency} price with {cap}"
            )
    if price > cap.amount:
        return Violation(p.name, "max_price_per_hour", f"over {cap}/h")
    return None


def _any(value: str, patterns: Sequence[str]) -> bool:
    return any(fnmatchcase(value, pat) for pat in patterns)
