"""Latency vs load for a chosen plan, as a PNG (matplotlib, Agg backend, imported lazily)."""

from __future__ import annotations

from pathlib import Path


def plot_latency_vs_load(
    *,
    path: Path,
    title: str,
    rates: list[float],
    ttft_p99_ms: list[float],
    itl_p99_ms: list[float],
    ttft_slo_ms: float,
    itl_slo_ms: float,
    planned_rate: float,
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    top.plot(rates, ttft_p99_ms, marker="o", label="TTFT p99")
    top.axhline(ttft_slo_ms, color="red", linestyle="--", label="TTFT SLO")
    top.set_ylabel("ms")
    top.set_yscale("log")
    top.legend(loc="upper left")
    bottom.plot(rates, itl_p99_ms, marker="o", color="tab:green", label="ITL p99")
    bottom.axhline(itl_slo_ms, color="red", linestyle="--", label="ITL SLO")
    bottom.set_ylabel("ms")
    bottom.set_yscale("log")
    bottom.set_xlabel("offered load (requests/s)")
    bottom.legend(loc="upper left")
    for axis in (top, bottom):
        axis.axvline(planned_rate, color="grey", linestyle=":")
        axis.grid(True, which="both", alpha=0.3)
    top.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
