"""The fleet simulator's parts; :mod:`splitserve_planner.simulator` is the public face.

* :mod:`.config` — what to simulate: engine, fleet, autoscaling and run settings.
* :mod:`.state` — event kinds, the job and pod records, and the shared simulation state.
* :mod:`.router` — where an arriving request or a finished prefill goes.
* :mod:`.engine` — one pod's engine steps: scheduling, decode aggregates, preemption.
* :mod:`.scaling` — the operator's autoscaling decision, as a periodic event.
* :mod:`.observe` — what the SLO controller reads at a tick: step-counter deltas of live pods,
  gauges, window latencies and load; GPU-seconds held.
* :mod:`.results` — timeline samples, pool statistics and latency percentiles.
"""
