"""Azure adapter. Importing this package imports no Azure SDK module; they load on first use."""

from providers.azure.adapter import AzureProvider

__all__ = ["AzureProvider"]
