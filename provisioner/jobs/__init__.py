"""What the scheduler does, each job a module with ``run(app, now=None, …)`` that returns what it
did (or, with ``dry_run``, would do) and why: :mod:`.sweep`, :mod:`.recover`, :mod:`.reconcile`,
:mod:`.enforce` (budgets), :mod:`.scheduled_reports`; :mod:`.lease` keeps two schedulers on one
database from acting twice, :mod:`.metrics` serves Prometheus, :mod:`.daemon` runs them all on
their intervals (``provisioner scheduler run``); ``provisioner sweep`` runs them once.

Jobs sit above machines, planning and budgets, and below the CLI: nothing under them imports
them.
"""
