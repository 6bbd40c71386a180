"""Simulator fidelity: the fleet simulator on the calibrated step model against the real runtime.

One seeded workload per load level (Poisson arrivals, prompts uniform 32-512 tokens, outputs
8-64) runs twice:

1. through the real runtime engine (``LLMEngine``, tiny Llama on CPU, in-process, one torch
   thread): continuous batching, chunked prefill, prefix caching, requests added at their
   arrival times between steps as the server's engine loop does; TTFT and per-token ITL;
2. through the planner's fleet simulator (one aggregated pod, the same engine settings and KV
   capacity), its steps priced by :class:`splitserve_planner.calibrated_model.CalibratedStepCost`
   over the coefficients the SLO controller's own fit
   (:class:`splitserve_operator.autoscaler.slo.step_fit.StepFit`, no prior) computed from the
   engine's step counters during a separate calibration (closed-loop windows at six levels,
   :data:`CALIBRATION_LEVELS`, plus one run of the same kind of traffic, other requests, per
   rate): what the operator's fit would hold. Each window is handed to the fit as the operator
   does, its decode-only part and the rest (``StepSample.split``).

It prints TTFT and ITL p50/p99 of both, the absolute percentage error of each figure and their
median over all levels (the MAPE; target <= 10 %), the same for other step models
(:data:`VARIANTS`: 2x too fast and too slow are the yardstick), and the simulator's wall time
next to the real run's. ``--json PATH`` writes the figures.

    python bench/sim_fidelity.py [--clock wall|cpu|model] [--seconds 8] [--rates 8,20,40]

Clocks (:class:`StepTimer`): ``wall`` (the default) is real time, as a pod sees it; ``cpu``
advances a virtual clock by the engine thread's CPU time per step, which removes most of the
other tenants' load of a shared machine; ``model`` gives each step the duration a fixed step
model assigns to its counted work, which removes the machine altogether and leaves what the
simulator is responsible for (scheduling, batching, queueing) plus the counters and the fit.
On the shared 2-core machine this was written on, with other work running, the same workload
run twice back to back differed from itself by a median 32 % (wall) and 14 % (CPU time) over
these figures: the speed drifts with the load by ±25 % within a minute, between calibration and
run too. Figures with the machine otherwise idle: docs/slo-autoscaling-simulation.md,
"Simulator fidelity" (before the split, windows of the totals over-priced the large prefill
steps that make the p99s: 7.5-11.9 % on wall time; with it, see there).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from splitserve_contract import ServeArgs
from splitserve_operator.autoscaler.slo.inputs import StepCoefficients, StepSample
from splitserve_operator.autoscaler.slo.step_fit import StepFit
from splitserve_planner.calibrated_model import CalibratedStepCost
from splitserve_planner.simulator import (
    AGGREGATED,
    EngineSettings,
    FleetConfig,
    SimResult,
    simulate,
)
from splitserve_planner.workload import Arrivals, LengthDist, Request, WorkloadSpec
from splitserve_runtime.engine.llm_engine import LLMEngine
from splitserve_runtime.engine.outputs import RequestOutput
from splitserve_runtime.engine.sampling_params import SamplingParams
from splitserve_runtime.engine.stats import EngineStats


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineSetup:
    block_size: int = 16
    num_kv_blocks: int = 2048
    max_model_len: int = 2048
    max_num_batched_tokens: int = 1024
    max_num_seqs: int = 64
    prefix_caching: bool = True

    def serve_args(self, model_dir: Path) -> ServeArgs:
        return ServeArgs(
            model=str(model_dir),
            device="cpu",
            block_size=self.block_size,
            num_kv_blocks=self.num_kv_blocks,
            max_model_len=self.max_model_len,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
            prefix_caching=self.prefix_caching,
            chunked_prefill=True,
        )

    def fleet(self) -> FleetConfig:
        return FleetConfig(
            mode=AGGREGATED,
            aggregated_replicas=1,
            router_policy="least-load",
            engine=EngineSettings(
                max_num_seqs=self.max_num_seqs,
                max_batched_tokens=self.max_num_batched_tokens,
                block_size=self.block_size,
                prefix_caching=self.prefix_caching,
            ),
        )


# ------------------------------------------------------------------ counters → step samples
def counter_sample(before: EngineStats, after: EngineStats) -> StepSample:
    """The increase of the engine-step counters between two snapshots: one regression point."""
    return StepSample(
        steps=after.engine_steps_total - before.engine_steps_total,
        seconds=after.engine_step_seconds_total - before.engine_step_seconds_total,
        prefill_tokens=after.engine_prefill_tokens_total - before.engine_prefill_tokens_total,
        prefill_attention_pairs=(
            after.engine_prefill_attention_pairs_total - before.engine_prefill_attention_pairs_total
        ),
        decode_rows=after.engine_decode_rows_total - before.engine_decode_rows_total,
        decode_context_tokens=after.engine_decode_context_tokens_total - before.engine_decode_context_tokens_total,
    )


def window_samples(
    before: EngineStats, after: EngineStats, *, seconds: float | None = None, decode_only_seconds: float = 0.0
) -> list[StepSample]:
    """The window as the operator's fit takes it: the decode-only part and the rest
    (``StepSample.split``). ``seconds`` / ``decode_only_seconds``: the busy times in a virtual
    clock (:class:`StepTimer`) instead of the engine's wall-time counters."""
    total = counter_sample(before, after)
    decode_only = after.engine_decode_only_step_seconds_total - before.engine_decode_only_step_seconds_total
    if seconds is not None:
        total, decode_only = dataclasses.replace(total, seconds=seconds), decode_only_seconds
    return total.split(
        decode_only_steps=after.engine_decode_only_steps_total - before.engine_decode_only_steps_total,
        decode_only_seconds=decode_only,
        decode_only_rows=after.engine_decode_only_rows_total - before.engine_decode_only_rows_total,
        decode_only_context_tokens=(
            after.engine_decode_only_context_tokens_total - before.engine_decode_only_context_tokens_total
        ),
    )


def predicted_seconds(theta: StepCoefficients, sample: StepSample) -> float:
    return sum(c * x for c, x in zip(theta.as_tuple(), sample.features(), strict=True))


# ------------------------------------------------------------------ clocks
CLOCKS = ("wall", "cpu", "model")
MODEL_CLOCK_COEFFICIENTS = StepCoefficients(
    step=1.0e-3, prefill_token=1.5e-5, prefill_pair=3.0e-8, decode_row=5.0e-5, decode_context=3.0e-7
)
"""``clock="model"``: each step lasts what these say for its counted work (about the tiny Llama
on one of this machine's cores), times seeded noise (lognormal, :data:`MODEL_CLOCK_NOISE`)."""
MODEL_CLOCK_NOISE = 0.1


class StepTimer:
    """Times one ``engine.step()`` in the run's clock.

    ``wall``: real time (the busy seconds of windows from the engine's own counter); ``cpu``: this
    thread's CPU time in the step (other tenants' load mostly excluded); ``model``: the engine
    really runs, but the step is given the duration :data:`MODEL_CLOCK_COEFFICIENTS` assign to
    the work its counters counted (no machine noise: what is compared is the scheduling, the
    batching and the counting, the simulator's and the runtime's)."""

    def __init__(self, engine: LLMEngine, *, clock: str, seed: int = 0) -> None:
        if clock not in CLOCKS:
            raise ValueError(f"clock must be one of {CLOCKS}, got {clock!r}")
        self.engine = engine
        self.clock = clock
        self.rng = np.random.default_rng([seed, 11])
        self._stats = engine.stats()

    def step(self) -> tuple[list[RequestOutput], float, bool]:
        """The step's outputs, its duration in this clock, and whether it computed no prefill
        (the decode-only part of the counters; always False on the wall clock, whose windows
        take both parts from the engine's own counters)."""
        if self.clock == "wall":
            return self.engine.step(), 0.0, False
        cpu0, wall0 = time.thread_time(), time.monotonic()
        outputs = self.engine.step()
        seconds = time.thread_time() - cpu0 if self.clock == "cpu" else time.monotonic() - wall0
        stats = self.engine.stats()
        work = counter_sample(self._stats, stats)
        self._stats = stats
        if self.clock == "model":
            seconds = (
                0.0
                if not work.steps
                else predicted_seconds(MODEL_CLOCK_COEFFICIENTS, work)
                * float(self.rng.lognormal(-(MODEL_CLOCK_NOISE**2) / 2, MODEL_CLOCK_NOISE))
            )
        return outputs, seconds, bool(work.steps) and not work.prefill_tokens

    def resync(self) -> None:
        """Requests were added or aborted outside :meth:`step` (no work counted there)."""
        self._stats = self.engine.stats()


# ------------------------------------------------------------------ calibration traffic
@dataclasses.dataclass(frozen=True)
class LoadLevel:
    """Closed loop: ``concurrency`` requests in flight, lengths ±25 % around these."""

    concurrency: int
    prompt_tokens: int
    output_tokens: int


CALIBRATION_LEVELS = (
    LoadLevel(1, 32, 96),
    LoadLevel(8, 128, 32),
    LoadLevel(32, 32, 128),
    LoadLevel(4, 768, 4),
    LoadLevel(16, 384, 16),
    LoadLevel(2, 1536, 2),
)
"""One long decode, a medium mix, 32 decodes, long prompts, a heavy mix, very long prompts."""


class ClosedLoopTraffic:
    """Keeps a level's ``concurrency`` requests in flight (a new one as soon as one finishes)."""

    def __init__(self, engine: LLMEngine, *, seed: int, vocab_size: int = 500) -> None:
        self.engine = engine
        self.rng = np.random.default_rng(seed)
        self.vocab_size = vocab_size
        self.count = 0

    def window(self, level: LoadLevel, *, seconds: float, clock: str = "wall") -> list[StepSample]:
        """Run ``level`` for ``seconds`` of wall time; the window's counter increase, its
        decode-only part and the rest (:func:`window_samples`; busy seconds in ``clock``)."""
        engine = self.engine
        before = engine.stats()
        timer = StepTimer(engine, clock=clock, seed=self.count)
        deadline = time.monotonic() + seconds
        busy = busy_decode_only = 0.0
        while time.monotonic() < deadline:
            while engine.num_requests < level.concurrency:
                self._add(level)
            timer.resync()
            _, spent, decode_only = timer.step()
            busy += spent
            busy_decode_only += spent if decode_only else 0.0
        return window_samples(
            before, engine.stats(), seconds=None if clock == "wall" else busy, decode_only_seconds=busy_decode_only
        )

    def stop(self) -> None:
        for rid in [f"cal-{i}" for i in range(1, self.count + 1)]:
            self.engine.abort_request(rid)

    def _add(self, level: LoadLevel) -> None:
        prompt = int(level.prompt_tokens * self.rng.uniform(0.75, 1.25))
        output = max(1, int(level.output_tokens * self.rng.uniform(0.75, 1.25)))
        self.count += 1
        self.engine.add_request(
            request_id=f"cal-{self.count}",
            prompt_token_ids=[int(t) for t in self.rng.integers(3, self.vocab_size, prompt)],
            params=SamplingParams(temperature=0, max_tokens=output, ignore_eos=True),
        )


def calibrate(
    engine: LLMEngine, *, rounds: int, window_seconds: float, seed: int = 0, clock: str = "wall"
) -> tuple[StepCoefficients, list[StepSample]]:
    """The controller's fit (no prior) over ``rounds`` × :data:`CALIBRATION_LEVELS` windows."""
    traffic = ClosedLoopTraffic(engine, seed=seed)
    traffic.window(CALIBRATION_LEVELS[1], seconds=0.2)  # warm-up, not measured
    samples: list[StepSample] = []
    fit = StepFit.fresh(prior=None)
    elapsed = 0.0
    for _ in range(rounds):
        for level in CALIBRATION_LEVELS:
            window = traffic.window(level, seconds=window_seconds, clock=clock)
            elapsed += window_seconds
            fit.add(window, now_seconds=elapsed)
            samples.extend(window)
    traffic.stop()
    engine.block_manager.reset_prefix_cache()
    theta = fit.coefficients
    if theta is None:
        raise RuntimeError("the step fit found no solution from the calibration windows")
    return theta, samples


# ------------------------------------------------------------------ the measured workload
@dataclasses.dataclass(kw_only=True)
class RealRun:
    ttft_seconds: list[float]
    itl_seconds: list[float]
    wall_seconds: float
    counters: StepSample
    """The whole run's counter increase (busy time and work)."""
    windows: list[list[StepSample]]
    """Counter increases per :data:`ONLINE_WINDOW_SECONDS` (what the operator scrapes while it
    runs), each as the operator's fit takes it: its decode-only part and the rest."""
    span_seconds: float
    """First arrival to last output in the run's clock (the wall time, or the virtual CPU clock)."""


ONLINE_WINDOW_SECONDS = 0.5


def workload(
    *, rate: float, seconds: float, seed: int, prompt: str = "uniform:32:512", output: str = "uniform:8:64"
) -> list[Request]:
    spec = WorkloadSpec(
        arrivals=Arrivals(rate_per_second=rate),
        prompt_tokens=LengthDist.parse(prompt),
        output_tokens=LengthDist.parse(output),
    )
    return spec.generate(duration_seconds=seconds, seed=seed)


def serve(
    engine: LLMEngine, requests: Sequence[Request], *, seed: int, vocab_size: int = 500, clock: str = "wall"
) -> RealRun:
    """Open loop: add each request at its arrival (between steps), step until all finish.

    ``clock="wall"``: real time; latencies as the engine measures them, windows' busy time from
    its counters. ``cpu`` and ``model`` (:class:`StepTimer`): a virtual clock advanced by each
    step's time in that clock and jumped to the next arrival when idle; latencies and the
    windows' busy seconds in that clock (``cpu``: the same engine on a CPU of its own)."""
    timer = StepTimer(engine, clock=clock, seed=seed)
    virtual = clock != "wall"
    rng = np.random.default_rng([seed, 5])
    prompts = [[int(t) for t in rng.integers(3, vocab_size, r.num_prompt_tokens)] for r in requests]
    arrival: dict[str, float] = {}
    last: dict[str, float] = {}
    ttft: list[float] = []
    itl: list[float] = []
    windows: list[list[StepSample]] = []
    first = window_start = engine.stats()
    window_cpu = window_cpu_decode_only = 0.0

    def close_window() -> None:
        after = engine.stats()
        if after.engine_steps_total > window_start.engine_steps_total:
            windows.append(
                window_samples(
                    window_start,
                    after,
                    seconds=window_cpu if virtual else None,
                    decode_only_seconds=window_cpu_decode_only,
                )
            )

    start = time.monotonic()
    now_v = 0.0
    next_window = ONLINE_WINDOW_SECONDS
    index = 0
    while index < len(requests) or engine.has_unfinished():
        now = now_v if virtual else time.monotonic() - start
        while index < len(requests) and requests[index].arrival_seconds <= now:
            r = requests[index]
            rid = f"run-{seed}-{r.request_id}"
            arrival[rid] = r.arrival_seconds
            engine.add_request(
                request_id=rid,
                prompt_token_ids=prompts[index],
                params=SamplingParams(temperature=0, max_tokens=r.num_output_tokens, ignore_eos=True),
                arrival_time_s=start + r.arrival_seconds,
            )
            index += 1
        timer.resync()
        if now >= next_window:
            close_window()
            window_start, window_cpu, window_cpu_decode_only = engine.stats(), 0.0, 0.0
            next_window = now + ONLINE_WINDOW_SECONDS
        if not engine.has_unfinished():
            if virtual:
                now_v = requests[index].arrival_seconds
            else:
                time.sleep(max(0.0, requests[index].arrival_seconds - (time.monotonic() - start)))
            continue
        outputs, spent, decode_only = timer.step()
        now_v += spent
        window_cpu += spent
        window_cpu_decode_only += spent if decode_only else 0.0
        for out in outputs:
            if not out.new_token_ids:
                continue
            if not virtual:
                if out.ttft_seconds is not None:
                    ttft.append(out.ttft_seconds)
                itl.extend(out.itl_seconds)
                continue
            rid = out.request_id
            if rid not in last:
                ttft.append(now_v - arrival[rid])
                itl.extend([0.0] * (len(out.new_token_ids) - 1))
            else:
                itl.extend([now_v - last[rid]] + [0.0] * (len(out.new_token_ids) - 1))
            last[rid] = now_v
    wall = time.monotonic() - start
    close_window()
    engine.block_manager.reset_prefix_cache()
    counters = counter_sample(first, engine.stats())
    if virtual:
        counters = dataclasses.replace(counters, seconds=sum(s.seconds for w in windows for s in w))
    return RealRun(
        ttft_seconds=ttft,
        itl_seconds=itl,
        wall_seconds=wall,
        counters=counters,
        windows=windows,
        span_seconds=now_v if virtual else wall,
    )


def online_fit(windows: Sequence[Sequence[StepSample]], *, prior: StepCoefficients | None) -> StepCoefficients | None:
    """The controller's fit over a run's own windows, as the operator keeps it while serving."""
    fit = StepFit.fresh(prior=prior)
    for i, window in enumerate(windows):
        fit.add(window, now_seconds=(i + 1) * ONLINE_WINDOW_SECONDS)
    return fit.coefficients


def simulate_run(
    theta: StepCoefficients, requests: list[Request], *, setup: EngineSetup, kv_bytes_per_token: int
) -> SimResult:
    perf = CalibratedStepCost(
        coefficients=theta,
        kv_capacity_tokens=setup.num_kv_blocks * setup.block_size,
        kv_bytes_per_token=kv_bytes_per_token,
    )
    return simulate(fleet=setup.fleet(), perf=perf, requests=requests)


FIGURES = ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99")


def real_figures(run: RealRun) -> dict[str, float]:
    return {
        "ttft_p50": float(np.percentile(run.ttft_seconds, 50)),
        "ttft_p99": float(np.percentile(run.ttft_seconds, 99)),
        "itl_p50": float(np.percentile(run.itl_seconds, 50)),
        "itl_p99": float(np.percentile(run.itl_seconds, 99)),
    }


def sim_figures(result: SimResult) -> dict[str, float]:
    return {
        "ttft_p50": result.ttft_percentile(50),
        "ttft_p99": result.ttft_percentile(99),
        "itl_p50": result.itl_percentile(50),
        "itl_p99": result.itl_percentile(99),
    }


def percentage_errors(sim: dict[str, float], real: dict[str, float]) -> dict[str, float]:
    return {name: abs(sim[name] - real[name]) / real[name] for name in FIGURES}


VARIANTS = ("calibrated", "speed-tracked", "closed-loop", "online", "2x fast", "2x slow")
"""The simulator's step model:

* ``calibrated``: the controller's fit (no prior) over the counter windows of a separate
  calibration: the closed-loop levels of :data:`CALIBRATION_LEVELS` plus a run of the same
  kind of traffic (the same length distributions, other requests) at every level's rate: what
  the operator's fit holds after watching the service at several loads;
* ``speed-tracked``: that fit times one factor, the measured run's busy time over the time the
  fit predicts for the run's counted work: the machine's speed of the moment (a shared CPU
  drifts by ±25 % within a minute; the operator's fit follows it with forgetting);
* ``closed-loop``: the fit over the six closed-loop levels of :data:`CALIBRATION_LEVELS`
  instead: other traffic, other mix (how much the linear model depends on what it saw);
* ``online``: the controller's fit over the measured run's own counter windows with the
  calibrated model as its prior (all five coefficients re-fitted from one run's windows, nearly
  collinear: prefill and decode work both grow with the arrivals);
* ``2x fast`` / ``2x slow``: the calibrated model halved and doubled, the yardstick a bound
  must reject."""


@dataclasses.dataclass(kw_only=True)
class Calibration:
    theta: StepCoefficients
    """``calibrated`` (:data:`VARIANTS`)."""
    samples: list[StepSample]
    closed_loop: StepCoefficients
    closed_loop_samples: list[StepSample]


def calibrate_on_workload(
    engine: LLMEngine,
    *,
    rates: Sequence[float],
    seconds: float,
    seed: int,
    clock: str = "wall",
    extra: Sequence[StepSample] = (),
) -> tuple[StepCoefficients, list[StepSample]]:
    """The controller's fit (no prior) over the windows of one run per rate (requests of ``seed``)
    and the ``extra`` windows (the closed-loop levels, which tell prefill from decode work apart:
    one Poisson run's windows grow all features together)."""
    fit = StepFit.fresh(prior=None)
    samples: list[StepSample] = list(extra)
    for i, rate in enumerate(rates):
        run = serve(engine, workload(rate=rate, seconds=seconds, seed=seed + i), seed=seed + i, clock=clock)
        samples.extend(point for window in run.windows for point in window)
    for i, window in enumerate(samples):
        fit.add([window], now_seconds=(i + 1) * ONLINE_WINDOW_SECONDS)
    theta = fit.coefficients
    if theta is None:
        raise RuntimeError("the step fit found no solution from the calibration windows")
    return theta, samples


@dataclasses.dataclass(kw_only=True)
class LevelResult:
    rate: float
    requests: int
    real: dict[str, float]
    sim: dict[str, dict[str, float]]
    """Figures per :data:`VARIANTS` entry."""
    errors: dict[str, dict[str, float]]
    """Absolute percentage error of each figure, per variant."""
    real_wall_seconds: float
    sim_wall_seconds: float
    busy_fraction: float
    """The real run's busy time / its span."""
    busy_error: float
    """(measured − predicted) / predicted busy time of the whole run under the calibrated model."""
    online: StepCoefficients


def run_level(
    engine: LLMEngine,
    calibration: Calibration,
    *,
    rate: float,
    seconds: float,
    seed: int,
    setup: EngineSetup,
    kv_bytes_per_token: int,
    clock: str = "wall",
) -> LevelResult:
    theta = calibration.theta
    requests = workload(rate=rate, seconds=seconds, seed=seed)
    real = serve(engine, requests, seed=seed, clock=clock)
    if len(real.ttft_seconds) != len(requests):
        raise RuntimeError(f"{len(requests) - len(real.ttft_seconds)} requests did not finish")
    online = online_fit(real.windows, prior=theta) or theta
    counters = real.counters
    speed = counters.seconds / predicted_seconds(theta, counters)
    models = {
        "calibrated": theta,
        "speed-tracked": theta.scaled(speed),
        "closed-loop": calibration.closed_loop,
        "online": online,
        "2x fast": theta.scaled(0.5),
        "2x slow": theta.scaled(2.0),
    }
    real_fig = real_figures(real)
    sims = {
        name: simulate_run(model, requests, setup=setup, kv_bytes_per_token=kv_bytes_per_token)
        for name, model in models.items()
    }
    for result in sims.values():
        if result.num_unfinished:
            raise RuntimeError(f"the simulator left {result.num_unfinished} requests unfinished")
    figures = {name: sim_figures(result) for name, result in sims.items()}
    return LevelResult(
        rate=rate,
        requests=len(requests),
        real=real_fig,
        sim=figures,
        errors={name: percentage_errors(fig, real_fig) for name, fig in figures.items()},
        real_wall_seconds=real.wall_seconds,
        sim_wall_seconds=sims["calibrated"].wall_seconds,
        busy_fraction=counters.seconds / real.span_seconds,
        busy_error=speed - 1.0,
        online=online,
    )


def mape(levels: Sequence[LevelResult], variant: str = "calibrated") -> float:
    """Median absolute percentage error over every figure of every level."""
    return statistics.median(v for level in levels for v in level.errors[variant].values())


def build_engine(model_dir: Path, setup: EngineSetup) -> LLMEngine:
    return LLMEngine.from_args(setup.serve_args(model_dir))


def kv_bytes_per_token(engine: LLMEngine) -> int:
    config = getattr(engine.runner.model, "config", None)
    if config is None:
        return 1
    return int(2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 4)


def measure(
    *,
    model_dir: Path,
    rates: Sequence[float],
    seconds: float,
    calibration_seconds: float,
    calibration_rounds: int = 2,
    calibration_window_seconds: float = 0.3,
    setup: EngineSetup | None = None,
    seed: int = 1,
    clock: str = "wall",
) -> tuple[Calibration, list[LevelResult]]:
    """Calibrate (closed loop, then the same kind of traffic at every rate), then one level per rate."""
    setup = setup or EngineSetup()
    engine = build_engine(model_dir, setup)
    closed_loop, closed_loop_samples = calibrate(
        engine, rounds=calibration_rounds, window_seconds=calibration_window_seconds, clock=clock
    )
    theta, samples = calibrate_on_workload(
        engine, rates=rates, seconds=calibration_seconds, seed=seed + 1000, clock=clock, extra=closed_loop_samples
    )
    calibration = Calibration(
        theta=theta, samples=samples, closed_loop=closed_loop, closed_loop_samples=closed_loop_samples
    )
    kv_bytes = kv_bytes_per_token(engine)
    levels = [
        run_level(
            engine,
            calibration,
            rate=rate,
            seconds=seconds,
            seed=seed + i,
            setup=setup,
            kv_bytes_per_token=kv_bytes,
            clock=clock,
        )
        for i, rate in enumerate(rates)
    ]
    engine.close()
    return calibration, levels


def _coefficients(theta: StepCoefficients) -> str:
    return ", ".join(f"{k}={v:.3g}" for k, v in dataclasses.asdict(theta).items())


def report(calibration: Calibration, levels: Sequence[LevelResult]) -> str:
    lines = [
        f"calibrated step model ({len(calibration.samples)} counter windows, "
        f"{sum(s.seconds for s in calibration.samples):.1f} s busy): {_coefficients(calibration.theta)}",
        f"closed-loop fit ({len(calibration.closed_loop_samples)} windows): {_coefficients(calibration.closed_loop)}",
        f"{'rate':>5} {'reqs':>5} {'busy':>5} {'figure':>9} {'real ms':>9} {'sim ms':>9} {'err':>6} "
        + " ".join(f"{v:>13}" for v in VARIANTS[1:]),
        f"{'':>33}(sim ms and err: {VARIANTS[0]}; the other columns: err of each variant)",
    ]
    for level in levels:
        for name in FIGURES:
            lines.append(
                f"{level.rate:5.0f} {level.requests:5d} {level.busy_fraction:5.0%} {name:>9} "
                f"{1000 * level.real[name]:9.2f} {1000 * level.sim[VARIANTS[0]][name]:9.2f} "
                f"{level.errors[VARIANTS[0]][name]:6.1%} "
                + " ".join(f"{level.errors[v][name]:13.1%}" for v in VARIANTS[1:])
            )
        lines.append(
            f"      real run {level.real_wall_seconds:.2f} s wall, simulator "
            f"{level.sim_wall_seconds * 1000:.1f} ms wall "
            f"({level.real_wall_seconds / max(level.sim_wall_seconds, 1e-9):.0f}x faster); the run's busy "
            f"time vs the calibrated model's {level.busy_error:+.1%}; online fit: {_coefficients(level.online)}"
        )
    lines.append(
        f"MAPE (median over {len(FIGURES)} figures x {len(levels)} levels, target <= 10%): "
        + ", ".join(f"{v} {mape(levels, v):.1%}" for v in VARIANTS)
    )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=8.0, help="arrival span of each load level")
    parser.add_argument("--rates", default="8,20,40", help="requests per second, one level each")
    parser.add_argument(
        "--calibration-seconds", type=float, default=6.0, help="arrival span of the calibration run at each rate"
    )
    parser.add_argument("--closed-loop-rounds", type=int, default=2)
    parser.add_argument("--model-dir", type=Path, default=None, help="default: a fresh tiny Llama")
    parser.add_argument(
        "--clock",
        choices=CLOCKS,
        default="wall",
        help="cpu: a virtual clock of the engine thread's CPU time (other tenants mostly excluded); "
        "model: steps last what a fixed step model says for their counted work (no machine noise)",
    )
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rates = [float(r) for r in args.rates.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model_dir
        if model_dir is None:
            from splitserve_runtime.model.tiny import write_tiny_model

            model_dir = write_tiny_model(out_dir=Path(tmp) / "tiny-llama", arch="llama", seed=0)
        calibration, levels = measure(
            model_dir=model_dir,
            rates=rates,
            seconds=args.seconds,
            calibration_seconds=args.calibration_seconds,
            calibration_rounds=args.closed_loop_rounds,
            clock=args.clock,
        )
    print(report(calibration, levels))
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {
                    "coefficients": dataclasses.asdict(calibration.theta),
                    "closedLoopCoefficients": dataclasses.asdict(calibration.closed_loop),
                    "levels": [dataclasses.asdict(level) for level in levels],
                    "clock": args.clock,
                    "mape": {v: mape(levels, v) for v in VARIANTS},
                },
                indent=2,
            )
            + "\n",
            encoding="utf-8",
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
