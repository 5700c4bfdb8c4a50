"""Google Cloud (Compute Engine) adapter. Importing this package imports no Google SDK."""

from providers.gcp.adapter import GCPProvider

__all__ = ["GCPProvider"]
