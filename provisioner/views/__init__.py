"""View models: what a page or a command shows, built by one function each and rendered by
the CLI (a table or JSON) and by the dashboard (Jinja), so that a figure both show is made
once. Plain typed dataclasses; money as :class:`provisioner.money.Money` (a Decimal with its
currency), unformatted: words, numbers and dates are the renderer's.

- :mod:`provisioner.views.status` — the fleet as listed (``status``, the dashboard's fleet) and
  one machine (``status NAME``, the dashboard's machine page).
- :mod:`provisioner.views.plan` — an experiment's plan (``plan``, the dashboard's Plan page).
- :mod:`provisioner.views.spend` — a report and the spend page (``report``, the dashboard's
  Spend page): per-day rows that add up to the total, one forecast per budget."""
