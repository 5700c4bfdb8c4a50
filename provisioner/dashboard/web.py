"""The dashboard as a WSGI application: routing and the pages — the fleet, a machine, spend,
alerts, plan — over the frame of :mod:`provisioner.dashboard.site` and the access checks of
:mod:`provisioner.dashboard.access`.

Acting (a machine page's forms, :meth:`Dashboard.act`): the CLI's own calls, as the signed-in
user (:func:`provisioner.acting.acting_as`: this request's thread only), allowed to the
machine's owner and to whom a policy grants ``act_as`` over them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any
from zoneinfo import ZoneInfo

from provisioner import acting, bill, budget, permits, render, reports
from provisioner.app import App
from provisioner.dashboard import pages, svg
from provisioner.dashboard.access import Access
from provisioner.dashboard.wsgi import (
    CSRF_COOKIE,
    Environ,
    Request,
    Response,
    StartResponse,
    TooLarge,
    accepts_gzip,
    host_allowed,
    host_name,
    safe_back,
    static_file,
)
from provisioner.errors import ProvisionerError, UserError
from provisioner.identity import SCHEDULER, may_act
from provisioner.views import alerts as alerts_view
from provisioner.views import fleet as fleet_view
from provisioner.views import plan as plan_view
from provisioner.views import spend as spend_view

log = logging.getLogger("provisioner.dashboard")

FLASH_COOKIE = "provisioner_done"  # what a machine page's action did, said once on the page
FLEET_SECONDS = 15  # a fleet page serves every request within this slice of the clock
SPEND_SECONDS = 300  # spend and budget standings: a pass over a big ledger takes a while
#: what a machine page's forms do: the CLI's ``stop``, ``start``, ``keep --until``, ``keep
#: --cancel``, ``autostop DURATION``, ``autostop --cancel`` and ``down``
ACTS = ("stop", "start", "keep", "unkeep", "autostop", "unautostop", "down")
CONFIRM = {"stop", "down"}  # asked once more before they are done
DONE = {*ACTS, *(f"{a}-same" for a in ("stop", "start", "down", "unkeep", "unautostop"))}


class Dashboard(Access):
    """The WSGI callable (see :func:`provisioner.dashboard.make_app`)."""

    def __init__(
        self, app: App, *, token: str | None, open_access: bool, hosts: Iterable[str] = ()
    ) -> None:
        super().__init__(app, token=token, open_access=open_access, hosts=hosts)
        self.routes: dict[str, Callable[[Request], Response]] = {
            "/": self.fleet,
            "/spend": self.spend,
            "/spend.csv": self.spend_csv,
            "/fleet.csv": self.fleet_csv,
            "/alerts": self.alerts,
            "/plan": self.plan,
            "/login": self.login,
            "/logout": self.logout,
        }

    def __call__(self, environ: Environ, start_response: StartResponse) -> Iterable[bytes]:
        req = Request(environ)
        try:
            resp = self.handle(req)
        except ProvisionerError as e:  # bad input in a query: say it, like the CLI would
            resp = self.page(req, "error.html", status=400, message=str(e))
        except TooLarge as e:
            resp = Response(str(e), 413, "text/plain; charset=utf-8")
        except Exception:
            log.exception("dashboard: %s %s failed", req.method, req.path)
            resp = Response("internal error", 500, "text/plain; charset=utf-8")
        if req.new_csrf and resp.headers[0][1].startswith("text/html"):  # a page: its forms
            resp.headers.append(
                (
                    "Set-Cookie",
                    f"{CSRF_COOKIE}={req.csrf}; Path={req.root or '/'}; HttpOnly; "
                    "SameSite=Strict" + self._secure(req),
                )
            )
        return resp(start_response, accepts_gzip(environ.get("HTTP_ACCEPT_ENCODING", "")))

    def handle(self, req: Request) -> Response:
        if any("\x00" in k + v for k, v in req.query.items()):  # no name holds one: the
            # state refuses it (PostgreSQL text has no NUL), so no query may ask for one
            raise UserError("a query with a NUL character (%00): nothing is named so")
        if (early := self._before_access(req)) is not None:
            return early
        self.app.refresh_rules()  # an admin's new team rules count from the next request
        if req.method == "POST" and (refused := self._cross_site(req)):
            return Response(refused, 403, "text/plain; charset=utf-8")
        if req.path != "/login" and (wait := self._held(req)):
            return self.too_many(req, wait)
        if req.path != "/login" and not self.allowed(req):
            return self.unauthenticated(req)
        if req.path.startswith("/machine/"):
            return self.machine(req, req.path.removeprefix("/machine/"))
        route = self.routes.get(req.path)
        if route is None:
            return self.page(req, "error.html", status=404, message=self.t(req, "dash_not_found"))
        return route(req)

    def _before_access(self, req: Request) -> Response | None:
        """What is answered before any access check: a host not ours (421), the static files,
        the favicon and the language switch; None: the rest."""
        host = host_name(req.environ.get("HTTP_HOST") or "")  # every browser sends one
        if host and not host_allowed(host, self.hosts):
            return Response(
                f"this dashboard does not answer to {host!r}: add it to dashboard.hosts in "
                "settings",
                421,
                "text/plain; charset=utf-8",
            )
        if req.path.startswith("/static/"):
            return static_file(req.path.removeprefix("/static/"), req.query.get("v"))
        if req.path == "/favicon.ico":  # every browser asks; no icon, and nothing secret
            return Response(status=204, headers=[("Cache-Control", "max-age=86400")])
        if req.path == "/lang":
            return self.set_language(req)
        return None

    def _fleet(self, req: Request, paged: bool = True) -> fleet_view.Fleet:
        now = self.now()
        f = render.Fmt(self.language(req))
        query = fleet_view.mine_first(req.query, self.acting_user(req))
        key = ("fleet", f.language, paged, tuple(sorted(query.items())))
        return self.cached(
            key,
            FLEET_SECONDS,
            lambda: fleet_view.fleet(self.app, now, f, query, paged, self._standings),
        )

    def _standings(self) -> list[budget.Status]:
        """Every budget's standing, shared by the pages of the same slice (the spend page's
        and the fleet's summary: one forecast per budget)."""
        now = self.now()
        return self.cached("standings", SPEND_SECONDS, lambda: spend_view.standings(self.app, now))

    def fleet(self, req: Request) -> Response:
        data = self._fleet(req)
        # what a row's act button just did (set by :meth:`act`, as on a machine page)
        mid, _, done = req.cookies.get(FLASH_COOKIE, "").partition(".")
        flash = None
        if done in DONE and mid:
            name = next((r.machine.name for r in data.rows if r.machine.id == mid), None)
            flash = self.t(req, f"dash_done_{done}", name=name or self._name(mid))
        resp = self.page(
            req,
            "fleet.html",
            fleet=data,
            spark_step=fleet_view.SPARK_STEP,
            section="fleet",
            states=fleet_view.STATES,
            may_act=lambda m: self.may_act(req, m),
            me=self.acting_user(req),
            everyone=fleet_view.EVERYONE,
            done=flash,
            undelivered=alerts_view.undelivered(self.app),
        )
        if FLASH_COOKIE in req.cookies:  # said once
            resp.headers.append(("Set-Cookie", self._flash(req, "", 0)))
        return resp

    def _name(self, mid: str) -> str:
        from provisioner.models import Machine

        with self.app.db.session() as s:
            m = s.get(Machine, mid)
            return m.name if m is not None else mid

    def fleet_csv(self, req: Request) -> Response:
        """The fleet page's rows, filtered and sorted as the page is, over every page: one line
        per machine and currency, amounts as exact numbers (what a spreadsheet sums)."""
        data = self._fleet(req, paged=False)
        lines = [line for r in data.rows for line in _csv_lines(r)]
        header = [
            "machine", "project", "owner", "cloud", "where", "gpu", "gpu_count", "market",
            "state", "idle_since", "currency", "cost", "per_hour", "next_action", "next_at",
        ]  # fmt: skip
        return Response(
            render.csv_table(header, lines),
            ctype="text/csv; charset=utf-8",
            headers=[("Content-Disposition", 'attachment; filename="fleet.csv"')],
        )

    def _spend(self, req: Request) -> spend_view.Spend:
        now, lang = self.now(), self.language(req)

        def budgets(r: reports.Report) -> list[budget.Status]:  # shared by every spend page
            return self.cached(
                "standings", SPEND_SECONDS, lambda: spend_view.standings(self.app, now, r)
            )

        key = ("spend", lang, tuple(sorted((k, v) for k, v in req.query.items() if v)))
        return self.cached(
            key,
            SPEND_SECONDS,
            lambda: spend_view.spend(self.app, now, lang, req.query, budgets),
        )

    def spend(self, req: Request) -> Response:
        data = self._spend(req)
        f = render.Fmt(self.language(req))
        r = data.report
        return self.page(
            req,
            "spend.html",
            s=data,
            r=r,
            prev=data.previous,
            days=(
                r.period.start.astimezone(ZoneInfo(r.period.tz)).date(),
                r.period.days()[-1],
            ),
            section="spend",
            by_choices=pages.BY,
            budget_names=[p.name for p in pages.budget_policies(self.app)],
            ownership=lambda o: render.ownership_text(r, o),
            unpriced=[render.unpriced_text(f, u) for u in r.unpriced],
            efficiency_text=render.efficiency_text,
            unusual_text=render.unusual_text,
            chart=_burndown(data, f),
            billed=bill.last_fetch(self.app, r.period.label),
            notices=alerts_view.recent(self.app, data.params.get("budget")),
        )

    def alerts(self, req: Request) -> Response:
        data = alerts_view.alerts(self.app, req.query)
        return self.page(
            req, "alerts.html", a=data, statuses=alerts_view.STATUSES, section="alerts"
        )

    def spend_csv(self, req: Request) -> Response:
        r = self._spend(req).report
        name = f"spend-{render._slug(r.title)}-{r.period.label}.csv"
        return Response(
            render.csv(r),
            ctype="text/csv; charset=utf-8",
            headers=[("Content-Disposition", f'attachment; filename="{name}"')],
        )

    def machine(
        self, req: Request, key: str, *, status: int = 200, refused: str | None = None
    ) -> Response:
        data = fleet_view.machine_page(self.app, self.now(), key)
        if data is None:
            return self.page(req, "error.html", status=404, message=self.t(req, "dash_not_found"))
        if req.method == "POST" and refused is None:
            return self.act(req, data.machine)
        # what the action just done did: from a cookie only this site sets (a link to
        # ?done=… from elsewhere could otherwise claim a stop that never happened)
        mid, _, done = req.cookies.get(FLASH_COOKIE, "").partition(".")
        resp = self.page(
            req,
            "machine.html",
            status=status,
            m=data.machine,
            d=data,
            row=fleet_view.row_of(
                self.app, self.now(), render.Fmt(self.language(req)), data.machine
            ),
            section="fleet",
            may_act=self.may_act(req, data.machine),
            signed_in=self.acting_user(req) is not None,
            budgets=[
                p.name
                for p in pages.budget_policies(self.app)
                if p.applies_to.matches(data.machine.project, data.machine.owner)
            ],
            back=_back(req),
            done=done if done in DONE and mid == data.machine.id else None,
            refused=refused,
        )
        if FLASH_COOKIE in req.cookies:  # said once
            resp.headers.append(("Set-Cookie", self._flash(req, "", 0)))
        return resp

    def _flash(self, req: Request, value: str, seconds: int) -> str:
        return (
            f"{FLASH_COOKIE}={value}; Path={req.root or '/'}; HttpOnly; SameSite=Strict; "
            f"Max-Age={seconds}" + self._secure(req)
        )

    # --- acting on a machine ----------------------------------------------------------------

    def acting_user(self, req: Request) -> str | None:
        """Who a POST acts as: the signed-in person (a personal token, its session, or a
        trusted proxy's user), on every address, loopback included. Never who serves this
        (the OS user or database role: anyone who can reach a loopback port is not them),
        nor the shared token (it names no one); None: no one, so nothing is done."""
        return req.user if req.user is not None and "@" in req.user else None

    def may_act(self, req: Request, m: Any) -> bool:
        """The machine's owner may act on it, and whom a policy that applies to it grants
        ``act_as`` its owner: the CLI's own rule (:func:`provisioner.identity.may_act`). A page
        is a person's: a user named as the scheduler acts as no one."""
        who = self.acting_user(req)
        if who is None or who == SCHEDULER:
            return False
        return may_act(self.app.policies, who, m.owner, m.project)

    def forbidden(self, req: Request, m: Any, who: str) -> Response:
        """403: ``who`` may not act on ``m``, in the CLI's words (:mod:`provisioner.permits`)
        in the page's language."""
        words = permits.refusal(who, m.owner, self.language(req))
        return self.machine(req, m.id, status=403, refused=words)

    def act(self, req: Request, m: Any) -> Response:
        """A form's action on machine ``m``, as the signed-in user (every event it writes
        records them); then back to the machine's page (303), or to the page the form names in
        ``back`` (a fleet row's: the list with its filters and sort), which says what was done.
        Stop and down ask first: a page whose form sends ``confirm=yes``. A refusal (policy,
        budget, state) is the CLI's own words on the machine's page: 409; not the owner: 403."""
        form = req.form()
        do = form.get("do", "")
        if do not in ACTS:
            return self.machine(
                req, m.id, status=400, refused=self.t(req, "dash_do_unknown", do=do[:40])
            )
        who = self.acting_user(req)
        if who is None:
            return self.machine(req, m.id, status=403, refused=self.t(req, "dash_do_sign_in"))
        if not self.may_act(req, m):
            return self.forbidden(req, m, who)
        back = _back(req)
        if do in CONFIRM and form.get("confirm") != "yes":
            return self.page(req, "confirm.html", m=m, do=do, section="fleet", back=back)
        try:
            with acting.acting_as(who):
                done = self._do(do, m.name, form)
        except permits.NotOwner:  # the rules changed since the check above
            return self.forbidden(req, m, who)
        except ProvisionerError as e:
            log.info("dashboard: %s %s by %s refused: %s", do, m.name, who, e)
            status = 409 if e.exit_code == 2 else 502
            return self.machine(req, m.id, status=status, refused=str(e))
        with self._lock:
            self._cache.clear()  # the fleet shows what was just done
        log.info("dashboard: %s %s by %s: %s", do, m.name, who, done)
        return Response(
            status=303,
            headers=[
                ("Location", _back_to_row(req, back, m.id)),
                ("Set-Cookie", self._flash(req, f"{m.id}.{done}", 60)),
            ],
        )

    def _do(self, do: str, name: str, form: dict[str, str]) -> str:
        """The CLI's own call for ``do`` (``provisioner stop``, ``keep``, ``autostop``…);
        what happened, a key of :data:`DONE`."""
        from provisioner import machines
        from provisioner.jobs import autostop, sweep

        a = self.app
        if do in ("stop", "start", "down"):
            _, changed = getattr(machines, do)(a, name)
            return do if changed else f"{do}-same"
        if do == "keep":
            sweep.keep(a, name, form.get("until", "").strip())
            return do
        if do == "unkeep":
            return do if sweep.unkeep(a, name)[1] else "unkeep-same"
        if do == "autostop":
            m, st = autostop.set_autostop(a, name, form.get("duration", "").strip())
            autostop.tell_machine(a, m, st)
            return do
        m, st, had = autostop.cancel_autostop(a, name)
        autostop.tell_machine(a, m, st)  # the machine's own guard: best effort, as the CLI
        return do if had else "unautostop-same"

    def plan(self, req: Request) -> Response:
        files = pages.experiment_files(self.app, self.app.settings.dashboard.experiments)
        result = None
        text = ""
        shown = req.query.get("file", "")  # a file picked: its text in the box, to edit
        if req.method == "GET" and shown in files:
            text = pages.file_text(shown)
        if req.method == "POST":
            form = req.form()
            text = form.get("text", "")
            picked = form.get("file", "")
            if picked and picked not in files:  # only the files offered, never any path
                result = plan_view.PlanPage(
                    picked, problems=[self.t(req, "dash_plan_unknown_file")]
                )
            elif picked:
                result = plan_view.plan_page(self.app, path=picked, owner=self.viewer(req))
                text = pages.file_text(picked)  # what was planned, in the box
            elif text.strip():
                result = plan_view.plan_page(self.app, text=text, owner=self.viewer(req))
        chosen = req.form().get("file", "") if req.method == "POST" else shown
        return self.page(
            req, "plan.html", files=files, result=result, text=text, picked=chosen, section="plan"
        )


def _csv_lines(r: fleet_view.Row) -> list[list[Any]]:
    """A fleet row's CSV lines: one per currency it cost or burns in (none: its own)."""
    currencies = sorted({mo.currency for mo in r.spent} | ({r.burn.currency} if r.burn else set()))
    return [_csv_line(r, c) for c in currencies or [r.machine.currency or ""]]


def _csv_line(r: fleet_view.Row, c: str) -> list[Any]:
    m = r.machine
    cost = next((mo.amount for mo in r.spent if mo.currency == c), None)
    per_hour = r.burn.amount if r.burn is not None and r.burn.currency == c else None
    return [
        m.name,
        m.project,
        m.owner,
        m.cloud,
        m.zone or m.region,
        m.gpu,
        m.gpu_count if m.gpu else None,
        m.market,
        m.status,
        r.idle.since.isoformat() if r.idle else None,
        c,
        cost,
        per_hour,
        r.move.action if r.move else None,
        r.next_at.isoformat() if r.next_at else None,
    ]


def _back_to_row(req: Request, back: str | None, mid: str) -> str:
    """Where a done action leads: the page its form was on, at the row acted on (live.js
    focuses it: the keyboard goes on from there, not from the top), else the machine's page."""
    if not back:
        return req.url(f"/machine/{mid}")
    return f"{req.root}{back.partition('#')[0]}#row-{mid}"


def _back(req: Request) -> str | None:
    """Where an act form sends the user when done: the page it was on (the fleet, with its
    filters and sort), a path on this site; None: the machine's page."""
    back = (req.form() if req.method == "POST" else req.query).get("back", "")
    return safe_back(back) if back else None


def _burndown(data: spend_view.Spend, f: render.Fmt) -> Any:
    """The spend chart: against the budget when one is shown, else spend and forecast."""
    r, b = data.report, data.report.budget
    running = data.today is not None
    has_budget = b is not None and data.policy is not None and data.policy.budget is not None
    forecast = r.shown_forecast
    return svg.burndown(
        [(d.day.isoformat(), d.spent.amount) for d in data.days],
        data.today,
        amount=b.amount.amount if b is not None and has_budget else None,
        forecast=forecast.amount if running and forecast is not None else None,
        committed_to=(b.spent + b.committed).amount if running and b is not None else None,
        thresholds=data.policy.budget.alerts.actual if has_budget else [],  # type: ignore[union-attr]
        labels={
            "title": f.t("dash_burndown"),
            "daily": f.t("dash_legend_day"),
            "budget": f.t("dash_legend_budget"),
            "spent": f.t("dash_legend_spent"),
            "committed": f.t("dash_legend_committed"),
            "forecast": f.t("dash_legend_forecast"),
        },
        money={"amount": f.money(b.amount) if b is not None else "", "top": r.currency},
        num=lambda v: f.num(v),
    )
