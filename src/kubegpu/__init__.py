"""kubegpu: a Kubernetes GPU device plugin in Python."""

__version__ = "0.1.0"
