"""Rebuild the shipped catalog CSVs from the reference price files (run by maintainers, not at
run time): ``python provisioner/data/catalog/build.py ../shared/reference/pricing``.

Every row keeps where its price came from. Unknown prices stay empty — never invented.
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import providers
from provisioner import catalog_checks

HERE = Path(__file__).parent
COLUMNS = [
    "cloud",
    "region",
    "zone",
    "instance_type",
    "gpu",
    "gpu_count",
    "gpu_memory_gb",
    "vcpus",
    "memory_gb",
    "price",
    "spot_price",
    "currency",
    "accelerator",
    "source",
    "as_of",  # the date the price was read from its source (ISO); empty: not known
]


def write(cloud: str, rows: list[dict]) -> None:
    """Check the rows (:mod:`provisioner.catalog_checks`: a price that fails is emptied, never
    guessed), then write the cloud's CSV and append what was emptied, and why, to ``checks.csv``."""
    rows.sort(
        key=lambda r: (r["gpu"], int(r["gpu_count"]), r["instance_type"], r["region"], r["zone"])
    )
    for r in rows:
        r["gpu_count"] = str(r["gpu_count"])
    findings = catalog_checks.check(rows, f"{cloud}.csv")
    where = ("cloud", "region", "zone", "instance_type")
    flags = [
        [f.file, f.line, f.check, *(f.row[c] for c in where), f.field, f.row[f.field], f.reason]
        for f in findings
    ]
    for finding in findings:
        finding.row[finding.field] = ""
    with (HERE / f"{cloud}.csv").open("w", newline="") as out:
        w = csv.DictWriter(out, fieldnames=COLUMNS, lineterminator="\n")
        w.writeheader()
        w.writerows(rows)
    with CHECKS.open("a", newline="") as out:
        csv.writer(out, lineterminator="\n").writerows(flags)
    counts = ", ".join(f"{k} {n}" for k, n in catalog_checks.summary(findings).items())
    print(f"{cloud}: {len(rows)} offers, {len(flags)} prices emptied ({counts or 'none'})")


CHECKS = HERE / "checks.csv"
CHECK_COLUMNS = [
    "file",
    "line",
    "check",
    "cloud",
    "region",
    "zone",
    "instance_type",
    "field",
    "value",
    "reason",
]


if __name__ == "__main__":
    ref = Path(sys.argv[1] if len(sys.argv) > 1 else "../shared/reference/pricing")
    with CHECKS.open("w", newline="") as f:
        csv.writer(f, lineterminator="\n").writerow(CHECK_COLUMNS)
    for name in providers.REGISTRY:  # each cloud's spec names its builder (none: hand-kept)
        build = providers.catalog_rows(name)
        if build is not None:
            write(name, build(ref))
