"""PNG plots of a loadgen run: latency percentiles against rate per mode, and goodput per mode."""
from __future__ import annotations

from pathlib import Path


def plot(all_points: dict[str, dict[str, list[dict]]], good: dict[str, dict[str, float]], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    mixes = sorted({mix for by_mix in all_points.values() for mix in by_mix})
    metrics = (("ttft", "TTFT"), ("tpot", "TPOT"), ("e2e", "end-to-end"))
    fig, axes = plt.subplots(len(mixes), len(metrics), figsize=(4.2 * len(metrics), 3.2 * len(mixes)), squeeze=False)
    for i, mix in enumerate(mixes):
        for j, (key, title) in enumerate(metrics):
            ax = axes[i][j]
            for mode, by_mix in all_points.items():
                points = by_mix.get(mix, [])
                rates = [p["rate_rps"] for p in points]
                color = None  # one colour per mode: p50 solid, p99 dashed
                for q, style in (("p50", "-o"), ("p99", "--x")):
                    ys = [p["latency_ms"][key][q] for p in points]
                    if any(y is not None for y in ys):
                        color = ax.plot(rates, ys, style, color=color, label=f"{mode} {q}", markersize=4)[0].get_color()
            ax.set_title(f"{mix}: {title}")
            ax.set_xlabel("rate (req/s)")
            ax.set_ylabel("ms")
            ax.set_yscale("log")
            ax.grid(True, alpha=0.3)
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    latency = out_dir / "loadgen-latency.png"
    fig.savefig(latency, dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(2.2 + 1.6 * len(mixes), 3.4))
    modes = list(good)
    width = 0.8 / max(len(modes), 1)
    for k, mode in enumerate(modes):
        xs = [i + k * width for i in range(len(mixes))]
        ax.bar(xs, [good[mode].get(mix, 0.0) for mix in mixes], width, label=mode)
    ax.set_xticks([i + width * (len(modes) - 1) / 2 for i in range(len(mixes))], mixes)
    ax.set_ylabel("goodput (req/s)")
    ax.set_title("goodput: highest rate with >= 90 % within both SLOs")
    ax.legend(fontsize=7)
    fig.tight_layout()
    goodput = out_dir / "loadgen-goodput.png"
    fig.savefig(goodput, dpi=110)
    plt.close(fig)
    return [latency, goodput]
