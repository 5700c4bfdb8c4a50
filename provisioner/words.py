"""The words provisioner says in each language: a gettext catalog per language
(``locale/<lang>/LC_MESSAGES/provisioner.po``, read with Babel), message ids being keys and
``en`` the source text. Reports, the dashboard and the CLI's refusals read the same catalog."""

from __future__ import annotations

from functools import cache
from pathlib import Path

LOCALE_DIR = Path(__file__).parent / "locale"


@cache
def messages(language: str) -> dict[str, str]:
    """Every message of ``language``, by id."""
    from babel.messages.pofile import read_po  # Babel: only when words are needed

    path = LOCALE_DIR / language / "LC_MESSAGES" / "provisioner.po"
    with path.open("rb") as f:
        catalog = read_po(f, locale=language)
    return {str(m.id): str(m.string) for m in catalog if m.id and m.string}
