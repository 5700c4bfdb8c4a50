"""SberCloud (cloud.ru Advanced) adapter, Huawei-ECS-compatible. Importing this package does not
import ``huaweicloudsdk*``; the adapter does that when first used."""

from providers.sbercloud.adapter import SberCloudProvider

__all__ = ["SberCloudProvider"]
