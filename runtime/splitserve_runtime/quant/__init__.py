"""Quantized weights: the runtime's layouts (:mod:`.formats`), the torch reference GEMMs
(:mod:`.reference`) and load-time quantizers (:mod:`.quantize`). Checkpoint formats are
parsed in :mod:`splitserve_runtime.model`; kernels live in :mod:`splitserve_runtime.kernels`.
"""
