"""AWS EC2 adapter (boto3, imported lazily). See :mod:`providers.aws.adapter`."""

from providers.aws.adapter import AWSProvider

__all__ = ["AWSProvider"]
