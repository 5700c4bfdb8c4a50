"""Notices to where the team reads: Telegram, Slack, a signed webhook, e-mail.

A notice is queued as one ``deliveries`` row per channel (its key makes it once), and
:func:`deliver` — a scheduler pass — sends the rows that are due. A delivery that fails for a
reason that may pass (a timeout, a 5xx, Telegram's 429 with ``retry_after``) is ``retrying`` at
a later pass, with backoff; one the receiver refuses for good, or after ``notify.max_attempts``,
is ``failed`` with the reason. Nothing sleeps in a pass.

Secrets (bot token, Slack webhook URL, signing key) are read from the environment when sending;
rows hold only the variables' names, and errors never carry the secret.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from fnmatch import fnmatchcase
from http import HTTPStatus
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError

from policies.channels import Channel
from provisioner import mail, outbound, redact
from provisioner.app import App
from provisioner.models import Delivery
from provisioner.schema import DELIVERY_DUE
from provisioner.schema import DeliveryStatus as D

#: what one topic says: (language) → (subject, text)
Texts = Callable[[str], tuple[str, str]]

BACKOFF_FIRST = 60  # seconds before the second try; doubled each try, at most BACKOFF_MAX
BACKOFF_MAX = 3600
TELEGRAM_MAX = 4096  # https://core.telegram.org/bots/api#sendmessage
CLAIM = timedelta(minutes=5)  # a row being sent is not taken by another scheduler meanwhile


@dataclass
class Notice:
    topic: str  # budget-alert | report | stop-warning | job-ended | preempted | …
    key: str  # one notice: the same key is queued once per channel
    texts: Texts
    policy: str | None = None
    machine: str | None = None
    language: str = "en"  # where the channel names none
    link: str = ""  # path under the dashboard's URL, when settings know it
    extra: dict[str, Any] = field(default_factory=dict)  # in the webhook's JSON


class Retry(Exception):
    """A failure that may pass: try again after ``after`` seconds (None: the backoff)."""

    def __init__(self, message: str, after: int | None = None) -> None:
        super().__init__(message)
        self.after = after


class Refused(Exception):
    """The receiver refused for good (bad token, unknown chat, missing secret)."""


# --- who is told -------------------------------------------------------------------------------


def channels_for(app: App, project: str | None, owner: str | None) -> list[tuple[Channel, str]]:
    """The channels of the policies that apply to (project, owner), then the owner's own from
    settings (keys may be globs), each with its language; the same channel once."""
    out: list[tuple[Channel, str]] = []
    if project is not None and owner is not None:
        for p in app.policies:
            if p.notify and p.applies_to.matches(project, owner):
                lang: str = p.budget.language if p.budget else "en"
                out += [(c, c.language or lang) for c in p.notify]
    for pattern, chans in app.settings.notify.owners.items():
        if owner is not None and fnmatchcase(owner, pattern):
            out += [(c, c.language or "en") for c in chans]
    seen: set[tuple[str, str]] = set()
    unique: list[tuple[Channel, str]] = []
    for item in out:
        if (item[0].kind, item[0].target) not in seen:
            seen.add((item[0].kind, item[0].target))
            unique.append(item)
    return unique


def queue(app: App, notice: Notice, channels: Iterable[tuple[Channel, str]]) -> int:
    """One ``pending`` row per channel (none where the notice's key already has one); how many
    were queued."""
    now = app.clock.now()
    base = app.settings.notify.dashboard_url
    hide = secrets(app)
    n = 0
    for channel, lang in channels:
        subject, text = (redact.redact(t, hide) for t in notice.texts(lang))
        if base:
            text += f"\n\n{base.rstrip('/')}{notice.link or '/'}"
        key = f"{notice.key}|{channel.kind}|{channel.target}"
        if len(key) > 255:
            key = key[:190] + "#" + hashlib.sha256(key.encode()).hexdigest()
        config = channel.model_dump(mode="json", exclude_none=True)
        config["extra"] = notice.extra
        try:
            with app.db.session() as s:
                s.add(
                    Delivery(
                        key=key,
                        at=now,
                        topic=notice.topic,
                        kind=channel.kind,
                        target=channel.target[:255],
                        channel=config,
                        subject=subject,
                        text=text,
                        policy=notice.policy,
                        machine=notice.machine,
                        status=D.PENDING,
                        attempts=0,
                        next_at=now,
                    )
                )
            n += 1
        except IntegrityError:
            continue
    return n


def tell(app: App, notice: Notice, project: str | None, owner: str | None) -> int:
    """Queue ``notice`` for the channels of (project, owner); never raises for a channel."""
    return queue(app, notice, channels_for(app, project, owner))


def tell_policy(app: App, notice: Notice, policy_name: str) -> int:
    """Queue ``notice`` for one policy's own channels (budget alerts and reports)."""
    for p in app.policies:
        if p.name == policy_name:
            lang = p.budget.language if p.budget else "en"
            return queue(app, notice, [(c, c.language or lang) for c in p.notify])
    return 0


def record_mail(
    app: App,
    key: str,
    topic: str,
    to: list[str],
    subject: str,
    error: str | None,
    *,
    retried: bool,
    policy: str | None = None,
    machine: str | None = None,
    supersedes: str | None = None,
) -> None:
    """A mail sent elsewhere (the budget's recipients, an owner's warning), recorded as a
    delivery: sent, or the failure (``retrying`` where the caller tries again next pass).
    ``supersedes``: a key prefix whose other mails still retrying are given up, this one
    taking their place (a budget's higher threshold)."""
    now = app.clock.now()
    status = D.SENT if error is None else (D.RETRYING if retried else D.FAILED)
    error = redact.redact(error, secrets(app)) if error else error
    key = f"{key}|mail"[:255]
    with app.db.session() as s:
        if supersedes:
            s.execute(
                update(Delivery)
                .where(
                    Delivery.key.startswith(supersedes, autoescape=True),
                    Delivery.key != key,
                    Delivery.kind == "email",
                    Delivery.status == D.RETRYING,
                )
                .values(status=D.FAILED, error=Delivery.error + f"; superseded by “{subject}”")
            )
        row = s.scalars(select(Delivery).where(Delivery.key == key)).first()
        if row is None:
            row = Delivery(
                key=key,
                at=now,
                topic=topic,
                kind="email",
                target=", ".join(to)[:255],
                channel={"email": to},
                subject=subject,
                text="",
                policy=policy,
                machine=machine,
                attempts=0,
            )
            s.add(row)
        row.attempts = (row.attempts or 0) + 1
        row.status, row.error, row.next_at = status, error, None
        row.done_at = now if status != D.RETRYING else None


# --- sending -----------------------------------------------------------------------------------


def deliver(app: App, now: datetime | None = None) -> list[str]:
    """Send every delivery that is due; what happened to each, one line apiece."""
    now = now or app.clock.now()
    cfg = app.settings.notify
    with app.db.session() as s:
        due = list(
            s.scalars(
                select(Delivery)
                .where(Delivery.status.in_(DELIVERY_DUE), Delivery.next_at <= now)
                .order_by(Delivery.id)
                .limit(200)
            )
        )
    out: list[str] = []
    hide = secrets(app) if due else []
    for d in due:
        with app.db.session() as s:  # claimed: another scheduler skips it meanwhile
            took = s.execute(
                update(Delivery)
                .where(Delivery.id == d.id, Delivery.next_at == d.next_at)
                .values(next_at=now + CLAIM)
            ).rowcount  # type: ignore[attr-defined]
        if not took:
            continue
        attempt = d.attempts + 1
        status, error, next_at = D.SENT, None, None
        try:
            _send(app, d)
        except Refused as e:
            status, error = D.FAILED, str(e)
        except Retry as e:
            error = str(e)
            if attempt >= cfg.max_attempts:
                status = D.FAILED
                error += f" (gave up after {attempt} attempts)"
            else:
                status = D.RETRYING
                wait = min(BACKOFF_FIRST * 2 ** (attempt - 1), BACKOFF_MAX)
                next_at = now + timedelta(seconds=max(wait, e.after or 0))
        except Exception as e:  # a bug, or a stored channel this version cannot read: say so
            status, error = D.FAILED, f"{type(e).__name__}: {e}"
        error = redact.redact(error, hide) if error else None
        with app.db.session() as s:
            s.execute(
                update(Delivery)
                .where(Delivery.id == d.id)
                .values(
                    status=status,
                    attempts=attempt,
                    error=error,
                    next_at=next_at,
                    done_at=None if status == D.RETRYING else now,
                )
            )
        line = f"{d.kind} {d.target}: {d.topic} {status}"
        if error:
            line += f": {error}"
        if next_at:
            line += f"; next try {next_at:%H:%M:%S} UTC"
        out.append(line)
    return out


def _send(app: App, d: Delivery) -> None:
    ch = Channel.model_validate({k: v for k, v in d.channel.items() if k != "extra"})
    if ch.telegram:
        token = _secret(ch.telegram.token_env)
        url = f"{app.settings.notify.telegram_api.rstrip('/')}/bot{token}/sendMessage"
        _telegram(app, url, telegram_payload(ch.telegram.chat_id, _text(d)))
    elif ch.slack:
        url = _secret(ch.slack.webhook_env)
        _slack(app, url, slack_payload(_text(d)))
    elif ch.webhook:
        key = _secret(ch.webhook.secret_env) if ch.webhook.secret_env else None
        _webhook(app, ch.webhook.url or _secret(ch.webhook.url_env or ""), d, key)
    else:
        smtp = app.settings.smtp
        msg = mail.compose(sender=smtp.sender, to=ch.email or [], subject=d.subject, text=d.text)
        try:
            mail.send(smtp, msg)
        except mail.MailError as e:
            raise Retry(str(e)) from None


def _text(d: Delivery) -> str:
    return f"{d.subject}\n\n{d.text}"


def telegram_payload(chat_id: int | str, text: str) -> dict[str, Any]:
    """``sendMessage`` with no ``parse_mode``: Telegram parses entities only in the mode named
    (https://core.telegram.org/bots/api#formatting-options: "MarkdownV2", "HTML"), so plain
    text needs no escaping — a name with ``*_[]()~`>#+-=|{}.!`` or ``<b>`` shows as written.
    "Text of the message to be sent, 1-4096 characters after entities parsing"
    (https://core.telegram.org/bots/api#sendmessage)."""
    return {"chat_id": chat_id, "text": text[:TELEGRAM_MAX]}


def slack_escape(text: str) -> str:
    """Slack's control characters as the entities it asks for: "Slack uses &, <, and > as
    control characters for special parsing in text objects, so they must be converted to HTML
    entities" and "You shouldn't HTML entity-encode the entire text"
    (https://api.slack.com/reference/surfaces/formatting#escaping). Without it a budget named
    ``<!channel>`` pings the whole channel."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def slack_payload(text: str) -> dict[str, Any]:
    """The incoming webhook's body: the text escaped, and ``mrkdwn: false`` ("Disable Slack
    markup parsing by setting to false", chat.postMessage's ``mrkdwn`` argument, which an
    incoming webhook's payload takes too) so ``*``, ``_`` and ``~`` in a name stay as written."""
    return {"text": slack_escape(text), "mrkdwn": False}


def _secret(name: str) -> str:
    """The variable's value without the whitespace around it: a secret made from a file ends
    in a newline (CRLF from an EnvironmentFile written on Windows) that is no part of it."""
    value = (os.environ.get(name) or "").strip()
    if not value:
        raise Refused(f"${name} is not set")
    return value


def secrets(app: App) -> list[str]:
    """Every channel secret this process may send with, as the environment holds it (with its
    newline, if any), and the SMTP password: what no row, line or page may show."""
    chans = [c for p in app.policies for c in p.notify]
    chans += [c for cs in app.settings.notify.owners.values() for c in cs]
    names = {n for c in chans for n in c.secret_names} | {mail.PASSWORD_ENV}
    return [v for n in sorted(names) if (v := os.environ.get(n))]


def _post(
    app: App, url: str, body: bytes, headers: dict[str, str]
) -> tuple[int, bytes, dict[str, str]]:
    """POST ``body`` where settings let it go (:mod:`provisioner.outbound`): (status, answer,
    headers); refused by our rules is :class:`Refused`, a network failure a :class:`Retry`,
    each with a short reason (never the URL nor the answer)."""
    cfg = app.settings.notify
    try:
        return outbound.post(url, body, headers, allow=cfg.allow, timeout=cfg.timeout_seconds)
    except outbound.Unreachable as e:
        raise (Refused if e.refused else Retry)(str(e)) from None


def _why(service: str, code: int) -> str:
    """A failed answer in a few words: the status and its reason phrase, never its body (the
    receiver's words are the receiver's: they may hold anything)."""
    try:
        phrase = HTTPStatus(code).phrase
    except ValueError:
        phrase = "unknown status"
    if 300 <= code < 400:
        phrase += ", redirect not followed"
    return f"{service} {code} ({phrase})"


def _json(body: bytes) -> dict[str, Any]:
    try:
        v = json.loads(body)
    except ValueError:
        return {}
    return v if isinstance(v, dict) else {}


def _telegram(app: App, url: str, payload: dict[str, Any]) -> None:
    """https://core.telegram.org/bots/api#making-requests: the answer is JSON with ``ok``; on
    failure ``error_code`` and ``description``, and on flood control (429)
    ``parameters.retry_after`` seconds (https://core.telegram.org/bots/api#responseparameters)."""
    body = json.dumps(payload).encode()
    code, raw, _ = _post(app, url, body, {"Content-Type": "application/json"})
    ans = _json(raw)
    if 200 <= code < 300 and ans.get("ok") is True:
        return
    why = _why("Telegram", code)
    if code == 429:
        params = ans.get("parameters") or {}
        raise Retry(why, int(params.get("retry_after") or 0) or None)
    if code >= 500:
        raise Retry(why)
    raise Refused(why)


def _slack(app: App, url: str, payload: dict[str, Any]) -> None:
    """https://api.slack.com/messaging/webhooks#handling_errors: 200 ``ok``; errors such as 400
    ``invalid_payload``, 403 ``invalid_token``, 404 ``no_service``, 410 ``channel_is_archived``
    are for good; 429 (rate limited, ``Retry-After``) and 5xx may pass."""
    body = json.dumps(payload).encode()
    code, _, headers = _post(app, url, body, {"Content-Type": "application/json"})
    if code == 200:
        return
    why = _why("Slack", code)
    if code == 429:
        after = headers.get("Retry-After") or headers.get("retry-after") or ""
        raise Retry(why, int(after) if after.isdigit() else None)
    if code >= 500:
        raise Retry(why)
    raise Refused(why)


def signature(key: str, body: bytes) -> str:
    """The ``X-Provisioner-Signature`` header: ``sha256=`` and the hex HMAC-SHA256 of the body."""
    return "sha256=" + hmac.new(key.encode(), body, hashlib.sha256).hexdigest()


def _webhook(app: App, url: str, d: Delivery, key: str | None) -> None:
    """A JSON POST; 2xx is delivered, 408, 429 and 5xx are tried again, other codes refuse."""
    payload = {
        "id": d.id,
        "topic": d.topic,
        "subject": d.subject,
        "text": d.text,
        "policy": d.policy,
        "machine": d.machine,
        "at": d.at.isoformat(),
        **(d.channel.get("extra") or {}),
    }
    body = json.dumps(payload, sort_keys=True).encode()
    headers = {"Content-Type": "application/json", "X-Provisioner-Delivery": str(d.id)}
    if key:
        headers["X-Provisioner-Signature"] = signature(key, body)
    code, _, _ = _post(app, url, body, headers)
    if 200 <= code < 300:
        return
    why = _why("webhook", code)
    if code in (408, 429) or code >= 500:
        raise Retry(why)
    raise Refused(why)


# --- what is shown -----------------------------------------------------------------------------


def recent(app: App, limit: int = 50) -> list[Delivery]:
    """The latest deliveries, newest first (events, the dashboard's alert history)."""
    with app.db.session() as s:
        rows = list(s.scalars(select(Delivery).order_by(Delivery.id.desc()).limit(limit)))
        s.expunge_all()
    return rows


# --- texts -------------------------------------------------------------------------------------

#: topic → language → (subject, text); ``{…}`` filled from the notice's values, a value given
#: as {"en": …, "ru": …} per language
TEXTS: dict[str, dict[str, tuple[str, str]]] = {
    "budget-alert": {
        "en": (
            "Budget {policy}: {what} {pct} % (threshold {threshold} %)",
            "Spent {spent} of {amount} this period ({period}); forecast {forecast}.",
        ),
        "ru": (
            "Бюджет {policy}: {what} {pct} % (порог {threshold} %)",
            "Потрачено {spent} из {amount} за период {period}; прогноз {forecast}.",
        ),
    },
    "budget-exhausted": {
        "en": (
            "Budget {policy} exhausted: {spent} of {amount}",
            "New launches are blocked until the period ends ({period}); on exhaustion: {action}.",
        ),
        "ru": (
            "Бюджет {policy} исчерпан: {spent} из {amount}",
            "Новые запуски запрещены до конца периода ({period}); при исчерпании: {action}.",
        ),
    },
    "report": {
        "en": (
            "Report {policy}, {period}: {spent} of {amount} ({pct} %)",
            "Spent {spent} of {amount}; committed {committed}; forecast {forecast}.",
        ),
        "ru": (
            "Отчёт {policy}, {period}: {spent} из {amount} ({pct} %)",
            "Потрачено {spent} из {amount}; обязательства {committed}; прогноз {forecast}.",
        ),
    },
    "stop-warning": {
        "en": (
            "{machine} will be {done} at {when} UTC",
            "{machine} ({where}): {why}.\nTo keep it running: provisioner keep {machine} "
            "--until {keep}",
        ),
        "ru": (
            "{machine} будет {done_ru} в {when} UTC",
            "{machine} ({where}): {why}.\nЧтобы оставить её работать: provisioner keep "
            "{machine} --until {keep}",
        ),
    },
    "job-ended": {
        "en": (
            "{machine}: job {jobs} ended: the machine was {done} ({reason})",
            "{machine} ({where}) was {done} while job {jobs} ran: {why}.\n"
            "The job ended with it (no exit code).",
        ),
        "ru": (
            "{machine}: задача {jobs} прервана: машина {done} ({reason})",
            "{machine} ({where}) {done}, пока шла задача {jobs}: {why}.\n"
            "Задача завершилась вместе с ней (без кода выхода).",
        ),
    },
    "preempted": {
        "en": ("{machine} was preempted", "{machine} ({where}) was preempted by its cloud."),
        "ru": ("{machine} вытеснена", "Облако вытеснило машину {machine} ({where})."),
    },
    "relaunched": {
        "en": (
            "{machine} relaunched on {where}",
            "{machine} was preempted; relaunched on {where}.",
        ),
        "ru": (
            "{machine} перезапущена в {where}",
            "Машина {machine} была вытеснена; перезапущена в {where}.",
        ),
    },
    "relaunch-refused": {
        "en": ("Relaunch of {machine} refused", "Relaunching {machine} was refused: {why}"),
        "ru": ("Перезапуск {machine} запрещён", "Перезапуск машины {machine} запрещён: {why}"),
    },
    "relaunch-failed": {
        "en": (
            "Relaunch of {machine} failed (try {attempt})",
            "Relaunching {machine} failed: {why}",
        ),
        "ru": (
            "Перезапуск {machine} не удался (попытка {attempt})",
            "Перезапуск машины {machine} не удался: {why}",
        ),
    },
    "relaunch-gave-up": {
        "en": ("Gave up relaunching {machine}", "{machine} ({where}): {why}."),
        "ru": (
            "Перезапуск {machine} прекращён",
            "{machine} ({where}): попытки перезапуска исчерпаны, машина оставлена как есть.",
        ),
    },
    "launched": {
        "en": (
            "{machine} launched after waiting for capacity",
            "{machine} (project {project}) launched on {where} after waiting since {since}.",
        ),
        "ru": (
            "{machine} запущена после ожидания мощностей",
            "{machine} (проект {project}) запущена в {where} после ожидания с {since}.",
        ),
    },
}


def texts(topic: str, **values: Any) -> Texts:
    """The topic's words in a language, filled with ``values``."""

    def render(lang: str) -> tuple[str, str]:
        lang = lang if lang in TEXTS[topic] else "en"
        v = {k: (x.get(lang, x.get("en")) if isinstance(x, dict) else x) for k, x in values.items()}
        subject, text = TEXTS[topic][lang]
        return subject.format(**v), text.format(**v)

    return render
