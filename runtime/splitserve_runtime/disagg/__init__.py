"""The prefill → decode KV handoff, in one place: the layer between the HTTP server and router
above and the engine below.

- :mod:`.prefill_request`: the prefill-only request the router and a decode pod send a
  prefill pod, and the reading of its answer (the router loads nothing else of this package);
- :mod:`.routes`: which engine path a request takes (export, import, local), decided once;
- :mod:`.prefiller`: a decode pod that drives its own prefill (an endpoint picker's header);
- :mod:`.engine`: :class:`~.engine.HandoffEngine`, the role's engine, with :mod:`.export`
  (prefill: keep, export, sign), :mod:`.decode_import` (decode: accept once, reserve, decode),
  :mod:`.pull` (the KV transfer into reserved blocks), :mod:`.pending` (imports waiting for
  room, woken by the engine thread), :mod:`.layout` (a parallel prefill pod's ranks) and
  :mod:`.background` (releases that outlive their caller).

The wire objects themselves (field names, JSON form, signed bytes) are the contract's
(:mod:`splitserve_contract.handoff`); the key and the MACs are :mod:`..transfer.auth`'s; the
engine's hooks (keep KV, reserve, activate) are :mod:`..engine.handoff`'s types. This package
imports nothing at package level, so the router's import of :mod:`.prefill_request` stays
torch-free.
"""
