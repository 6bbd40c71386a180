"""Library code of the benchmarks only (the scripts in ``bench/`` and their tests import it).

Why apart from the product: the SLO autoscaling comparison (:mod:`.slo_compare`) and its
seeded traces (:mod:`.slo_traces`) are a benchmark harness, not planner API; living here they
ship in neither the wheel nor the image. ``bench/`` is on the tests' path (pyproject's
``pythonpath``) and on mypy's; a script in ``bench/`` has it as its own folder.
"""
