"""Fleet sizing: a performance model, a discrete-event fleet simulator and a planner.

Layers, each talking only down:

* :mod:`.gpus`, :mod:`.model_presets` — data: accelerator specs and model shapes.
* :mod:`.precision` — activation dtype, weight quantization and KV cache dtype: bytes per
  weight and KV element, and the tensor-core rate of the GEMMs.
* :mod:`.perf_model` (roofline) and :mod:`.profile` (measured, versioned data files) — how long
  one engine step takes, and how many KV tokens a pod holds.
* :mod:`.workload` — request streams: Poisson, bursty (MMPP), or a replayed trace CSV.
* :mod:`.simulator` — the fleet: router, prefill/decode/aggregated pools with continuous
  batching, chunked prefill, KV capacity with preemption, prefix caching, KV transfer (its
  parts in :mod:`.sim`; the autoscaling decision in :mod:`.autoscale`).
* :mod:`.supported` — what a plan may use: this version's capabilities (the CRD's table).
* :mod:`.search` — the cheapest pool sizes meeting the SLOs under the headroom rule.
* :mod:`.manifest`, :mod:`.plot`, :mod:`.cli` — ``splitserve plan``.

Torch-free: the operator image imports this package.
"""
