"""``splitserve plan --slo``: what the SLO controller would do with the planned fleet.

Why in the planner: a plan sizes the fleet for the peak; the SLO controller
(:mod:`splitserve_operator.autoscaler.slo`) then moves it with the load. Running the operator's
own controller in the simulator over the planned workload shows, before deploying, the replicas
it would choose per pool over time, the GPU-hours and the SLO attainment — and the roofline
prior (:mod:`.slo_prior`) it would start from goes into the manifest as
``spec.autoscaling.slo.prior``, so the online fit starts from the planner's model instead of
from nothing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from splitserve_operator.autoscaler.slo.inputs import SloTarget

from .perf_model import StepCost
from .sim.config import AGGREGATED, AutoscaleSettings, EngineSettings, FleetConfig, SimOptions
from .sim.observe import gpu_seconds
from .simulator import Simulator
from .slo_attainment import attainment
from .slo_prior import PriorFit, fit_prior, prior_manifest
from .workload import Request

_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(ms|s|m)?\s*$")
_UNIT_SECONDS = {"ms": 1e-3, "s": 1.0, "m": 60.0, None: 1e-3}


def _seconds(text: str, *, key: str) -> float:
    match = _DURATION.match(text)
    if not match:
        raise ValueError(f"--slo {key}={text!r}: use a duration such as 500ms or 1.5s")
    value = float(match.group(1)) * _UNIT_SECONDS[match.group(2)]
    if value <= 0:
        raise ValueError(f"--slo {key} must be above 0")
    return value


def parse_slo(text: str) -> SloTarget:
    """``ttft=500ms,itl=50ms[,attainment=0.99][,headroom=0.8]`` (a bare number is milliseconds)."""
    fields: dict[str, str] = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        key = key.strip().lower()
        if not sep or key not in ("ttft", "itl", "attainment", "headroom") or key in fields:
            raise ValueError(f"bad --slo {text!r}: use ttft=500ms,itl=50ms[,attainment=0.99][,headroom=0.8]")
        fields[key] = value.strip()
    if "ttft" not in fields or "itl" not in fields:
        raise ValueError(f"--slo {text!r} needs both ttft= and itl=")
    try:
        quantile = float(fields.get("attainment", "0.99"))
        headroom = float(fields.get("headroom", "0.8"))
    except ValueError:
        raise ValueError(f"bad --slo {text!r}: attainment and headroom are fractions, e.g. 0.99") from None
    if not 0.5 < quantile < 1:
        raise ValueError(f"--slo attainment must be in (0.5, 1), got {quantile:g}")
    if not 0 < headroom <= 1:
        raise ValueError(f"--slo headroom must be in (0, 1], got {headroom:g}")
    return SloTarget(
        ttft_p99_seconds=_seconds(fields["ttft"], key="ttft"),
        itl_p99_seconds=_seconds(fields["itl"], key="itl"),
        attainment=quantile,
        headroom=headroom,
    )


@dataclass(frozen=True, kw_only=True)
class SloReport:
    """One simulated run of the SLO controller over the planned workload."""

    slo: SloTarget
    prior: PriorFit
    replicas: dict[str, list[tuple[float, int]]]
    """Per pool, ``(time_s, replicas)`` at every change (starting pods included)."""
    gpu_hours: float
    attainment: float
    num_requests: int
    ttft_seconds: float
    itl_seconds: float
    """TTFT and ITL at the attainment quantile over the run."""
    max_replicas: int


def simulate_controller(
    *,
    perf: StepCost,
    requests: list[Request],
    slo: SloTarget,
    mode: str,
    replicas: dict[str, int],
    engine: EngineSettings,
    gpus_per_replica: int,
    max_replicas: int,
    router_policy: str = "prefix-affinity",
    kv_link_bytes_per_second: float = 50e9,
    seed: int = 0,
) -> SloReport:
    """Run the SLO controller (roofline prior, no targets) from the planned ``replicas``."""
    prior = fit_prior(perf, max_batched_tokens=engine.max_batched_tokens, max_num_seqs=engine.max_num_seqs)
    settings = AutoscaleSettings(max_replicas=max_replicas, slo=replace(slo, prior=prior.coefficients))
    if mode == AGGREGATED:
        fleet = FleetConfig(
            mode=mode,
            aggregated_replicas=replicas["aggregated"],
            gpus_per_replica=gpus_per_replica,
            engine=engine,
            router_policy=router_policy,
            autoscale=settings,
            kv_link_bytes_per_second=kv_link_bytes_per_second,
        )
    else:
        fleet = FleetConfig(
            mode=mode,
            prefill_replicas=replicas["prefill"],
            decode_replicas=replicas["decode"],
            gpus_per_replica=gpus_per_replica,
            engine=engine,
            router_policy=router_policy,
            autoscale=settings,
            kv_link_bytes_per_second=kv_link_bytes_per_second,
        )
    sim = Simulator(
        fleet=fleet, perf=perf, requests=requests, options=SimOptions(sample_interval_seconds=5.0, seed=seed)
    )
    result = sim.run()
    end = requests[-1].arrival_seconds if requests else 0.0
    changes: dict[str, list[tuple[float, int]]] = {}
    for role in sim.pools:
        series = changes.setdefault(role, [])
        for row in result.timeline:
            if row["time_s"] > end:
                break
            count = int(row.get(f"{role}_replicas", 0.0) + row.get(f"{role}_starting", 0.0))
            if not series or series[-1][1] != count:
                series.append((row["time_s"], count))
    q = 100.0 * slo.attainment
    return SloReport(
        slo=slo,
        prior=prior,
        replicas=changes,
        gpu_hours=gpu_seconds(sim.all_pods, start_s=0.0, end_s=end, gpus_per_replica=gpus_per_replica) / 3600.0,
        attainment=attainment(
            ttft=result.ttft_seconds, tpot=result.tpot_seconds, num_requests=result.num_measured, slo=slo
        ),
        num_requests=result.num_measured,
        ttft_seconds=result.ttft_percentile(q),
        itl_seconds=result.itl_percentile(q),
        max_replicas=max_replicas,
    )


def format_report(report: SloReport, *, max_changes: int = 12) -> str:
    slo = report.slo
    met = "meets" if report.attainment >= slo.attainment else "MISSES"
    lines = [
        f"SLO controller (--slo ttft={slo.ttft_p99_seconds * 1e3:g}ms,itl={slo.itl_p99_seconds * 1e3:g}ms,"
        f"attainment={slo.attainment:g}), simulated over the workload from the planned counts "
        f"(replicas up to {report.max_replicas} per pool; the manifest caps them at the plan's):",
        f"  attainment {report.attainment:.2%} of {report.num_requests} requests ({met} {slo.attainment:.0%}); "
        f"TTFT p{slo.attainment * 100:g} {report.ttft_seconds * 1e3:.0f} ms, ITL p{slo.attainment * 100:g} "
        f"{report.itl_seconds * 1e3:.1f} ms; {report.gpu_hours:.3f} GPU-hours",
    ]
    for role, series in report.replicas.items():
        shown = series if len(series) <= max_changes else series[:max_changes]
        text = ", ".join(f"{t:.0f}s:{n}" for t, n in shown)
        more = f", ... ({len(series) - max_changes} more changes)" if len(series) > max_changes else ""
        counts = [n for _, n in series]
        lines.append(f"  {role} replicas {min(counts)}-{max(counts)}: {text}{more}")
    prior = prior_manifest(report.prior.coefficients)
    lines.append(
        "  roofline prior (spec.autoscaling.slo.prior, s/unit): "
        + ", ".join(f"{k}={v:.4g}" for k, v in prior.items())
        + f" (linear fit of the perf model over {report.prior.num_steps} steps, "
        f"RMS error {report.prior.relative_rms_error:.0%})"
    )
    return "\n".join(lines)


def slo_manifest(report: SloReport) -> dict[str, object]:
    """``spec.autoscaling.slo`` for the manifest."""
    slo = report.slo
    return {
        "ttftP99": f"{slo.ttft_p99_seconds * 1e3:g}ms",
        "itlP99": f"{slo.itl_p99_seconds * 1e3:g}ms",
        "attainment": slo.attainment,
        "headroom": slo.headroom,
        "prior": prior_manifest(report.prior.coefficients),
    }
