"""PNG plots for the serving benchmark (matplotlib, headless; skipped when it is missing)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from bench.serving_metrics import RequestRecord, RunRecord


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: plot skipped (pip install matplotlib)")
        return None
    return plt


def plot_sweep(results: list[RunRecord], path: Path) -> Path | None:
    """Throughput vs latency over a sweep: TTFT and ITL (p50 solid, p99 dashed) against output
    tok/s, one line per engine that has per-point metrics (vllmini and vLLM)."""
    plt = _pyplot()
    if plt is None:
        return None
    series: dict[str, list] = {"vllmini": [r.metrics for r in results]}
    for r in results:
        for b in r.baselines:
            if b.metrics is not None and b.ratio is not None:  # driven with this point's arrivals
                series.setdefault(b.name, []).append(b.metrics)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, title in ((axes[0], "ttft_s", "TTFT"), (axes[1], "itl_s", "ITL")):
        for k, (name, ms) in enumerate(series.items()):
            tput = [m.output_throughput for m in ms]
            color = f"C{k}"
            ax.plot(tput, [getattr(m, key).median * 1e3 for m in ms], "o-", color=color, label=f"{name} p50")
            ax.plot(tput, [getattr(m, key).p99 * 1e3 for m in ms], "s--", color=color, label=f"{name} p99")
        ax.set_xlabel("output tok/s")
        ax.set_ylabel(f"{title} (ms)")
        ax.set_title(f"{title} vs throughput")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_distributions(series: dict[str, list[RequestRecord]], path: Path, title: str) -> Path | None:
    """Empirical CDFs of TTFT and of every ITL gap, one line per engine."""
    plt = _pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, records in series.items():
        done = [r for r in records if r.ok]
        for ax, values in ((axes[0], [r.ttft for r in done]), (axes[1], [g for r in done for g in r.itls])):
            if values:
                v = np.sort(np.asarray(values)) * 1e3
                ax.plot(v, np.arange(1, len(v) + 1) / len(v), drawstyle="steps-post", label=f"{name} (n={len(v)})")
    for ax, what in ((axes[0], "TTFT"), (axes[1], "ITL")):
        ax.set_xscale("log")
        ax.set_xlabel(f"{what} (ms, log)")
        ax.set_ylabel("fraction of samples <= x")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
