"""What a command does, end to end, as one function the CLI, the dashboard and an API call alike:
a typed request in, typed events out as it goes (``progress``), a typed result back that each
surface renders in its own words. ``up`` (:mod:`.up`), the actions on many machines
(:mod:`.many`), ``gc`` (:mod:`.gc`) and the catalog's commands (:mod:`.catalog`)."""
