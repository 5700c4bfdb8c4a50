"""Pure policy rules: schema, evaluation, off-hours calendars. No I/O but reading YAML files;
imports nothing from provisioner/ or providers/."""

from policies.schema import (
    Amount,
    Budget,
    IdleRule,
    MaxLifetime,
    OffHours,
    Policy,
    matching,
)

__all__ = ["Amount", "Budget", "IdleRule", "MaxLifetime", "OffHours", "Policy", "matching"]
