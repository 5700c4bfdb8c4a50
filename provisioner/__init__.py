"""provisioner: rent GPUs across clouds without wasting money."""

__version__ = "0.1.0"
