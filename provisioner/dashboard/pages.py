"""What the pages offer to pick from (experiment files). What each page shows is a view
model of :mod:`provisioner.views`, the CLI's own: the fleet and a machine
(:mod:`provisioner.views.fleet`), spend (:mod:`provisioner.views.spend`) and a plan
(:mod:`provisioner.views.plan`)."""

from __future__ import annotations

from sqlalchemy import select

from provisioner.app import App
from provisioner.models import Machine
from provisioner.views.fleet import when
from provisioner.views.spend import BY, budget_policies, standings

__all__ = ["BY", "budget_policies", "experiment_files", "standings", "when"]


def experiment_files(app: App, dirs: list[str]) -> list[str]:
    """Files to pick from: the experiment files of ``dirs`` (settings) and those machines were
    launched from, when they still exist."""
    from pathlib import Path

    found: set[str] = set()
    for d in dirs:
        p = Path(d).expanduser()
        if p.is_dir():
            found.update(str(f) for f in p.glob("*.y*ml"))
        elif p.is_file():
            found.add(str(p))
    with app.db.session() as s:
        for (sp,) in s.execute(select(Machine.spec_path).where(Machine.spec_path.is_not(None))):
            if sp and Path(sp).is_file():
                found.add(str(Path(sp).resolve()))
    return sorted(found)


def file_text(path: str) -> str:
    """An offered experiment file's text (:func:`experiment_files`), for the Plan page's box;
    "" when it cannot be read."""
    from pathlib import Path

    try:
        return Path(path).read_text(encoding="utf-8", errors="replace")[:FILE_CHARS]
    except OSError:
        return ""


FILE_CHARS = 256 * 1024  # the form takes as much (wsgi.MAX_FORM)
