"""splitserve operator: reconciles InferenceService objects into prefill/decode/router
workloads and autoscales the pools from Prometheus metrics. Imports without torch."""

from splitserve_contract import __version__

__all__ = ["__version__"]
