"""Pure policy rules: schema (policies.schema), evaluation (policies.evaluate), off-hours
calendars (policies.calendar), loading (policies.loader). No I/O but reading YAML files; imports
nothing from provisioner/ or providers/. Submodules are imported where used, so importing this
package costs nothing."""
