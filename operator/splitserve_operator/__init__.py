"""splitserve operator: reconciles InferenceService objects into prefill/decode/router
workloads and autoscales the pools from Prometheus metrics. Imports without torch."""

__version__ = "0.1.0"
