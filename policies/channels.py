"""Notify channels (``notify:`` in a policy, ``notify.owners`` in settings): where a notice goes
beside the budget's mail. Secrets (bot tokens, webhook URLs, signing keys) are never written
here: only the names of the environment variables that hold them."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, defer_build=True)


ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"  # the name of an environment variable holding a secret


class Telegram(_Strict):
    """Bot API ``sendMessage`` (https://core.telegram.org/bots/api#sendmessage) to ``chat_id``;
    the bot token is read from the variable ``token_env`` when sending, never stored."""

    chat_id: int | str
    token_env: str = Field(pattern=ENV_NAME)


class Slack(_Strict):
    """An incoming webhook (https://api.slack.com/messaging/webhooks): its URL is a secret, so
    only the variable ``webhook_env`` holding it is written here."""

    webhook_env: str = Field(pattern=ENV_NAME)


class Webhook(_Strict):
    """A JSON POST to ``url`` — or, where the URL holds a token, to the URL in the variable
    ``url_env``, never stored — signed with HMAC-SHA256 of the body under the secret in
    ``secret_env`` (header ``X-Provisioner-Signature: sha256=<hex>``)."""

    url: str | None = Field(None, pattern=r"^https?://[^/\s]+(/\S*)?$")
    url_env: str | None = Field(None, pattern=ENV_NAME)
    secret_env: str | None = Field(None, pattern=ENV_NAME)

    @model_validator(mode="after")
    def _one_url(self) -> Webhook:
        if (self.url is None) == (self.url_env is None):
            raise ValueError("give exactly one of url, url_env")
        return self


class Channel(_Strict):
    """One place a notice goes: exactly one of ``telegram``, ``slack``, ``webhook``, ``email``;
    ``language`` (en, ru) picks its texts (default: the budget's language, else en)."""

    telegram: Telegram | None = None
    slack: Slack | None = None
    webhook: Webhook | None = None
    email: list[str] | None = None
    language: Literal["en", "ru"] | None = None

    @model_validator(mode="after")
    def _one(self) -> Channel:
        given = [k for k in ("telegram", "slack", "webhook", "email") if getattr(self, k)]
        if len(given) != 1:
            raise ValueError("give exactly one of telegram, slack, webhook, email")
        return self

    @field_validator("email")
    @classmethod
    def _emails(cls, v: list[str] | None) -> list[str] | None:
        for r in v or []:
            if not re.match(r"^[^@\s]+@[^@\s]+\.[^@\s]+$", r):
                raise ValueError(f"not an email address: {r!r}")
        return v

    @property
    def kind(self) -> str:
        return next(k for k in ("telegram", "slack", "webhook", "email") if getattr(self, k))

    @property
    def secret_names(self) -> list[str]:
        """The variables holding this channel's secrets."""
        t, sl, w = self.telegram, self.slack, self.webhook
        names = [t.token_env if t else None, sl.webhook_env if sl else None]
        names += [w.url_env, w.secret_env] if w else []
        return [n for n in names if n]

    @property
    def target(self) -> str:
        """Where it goes, without any secret: shown in events and on the dashboard."""
        if self.telegram:
            return f"chat {self.telegram.chat_id}"
        if self.slack:
            return f"${self.slack.webhook_env}"
        if self.webhook:
            return (
                self.webhook.url.split("?")[0] if self.webhook.url else f"${self.webhook.url_env}"
            )
        return ", ".join(self.email or [])
