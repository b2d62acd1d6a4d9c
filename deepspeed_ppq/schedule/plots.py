"""PNG timeline and per-stage memory chart of a simulated step (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path

from .simulator import SimResult

__all__ = ["plot_timeline", "plot_memory"]

_COLORS = {"F": "#4c8bd6", "B": "#e0903a", "W": "#5aab61", "act": "#9aa6b2", "grad": "#c77b7b"}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_timeline(result: SimResult, path: str | Path, title: str | None = None) -> Path:
    """One row per rank: F/B/W boxes labelled with the micro-batch, transfers as thin bars below."""
    plt = _plt()
    p = len(result.per_stage)
    scale, unit = (1e3, "ms") if result.step_time < 10 else (1.0, "s")
    fig, ax = plt.subplots(figsize=(12, 0.6 * p + 1.6))
    many = sum(1 for e in result.events if e[0] != "comm") > 400
    for e in result.events:
        if e[0] == "comm":
            _, src, _dst, _b, what, _mb, t0, t1 = e
            ax.barh(src + 0.38, (t1 - t0) * scale, left=t0 * scale, height=0.14, color=_COLORS[what])
            continue
        r, kind, mb, chunk, _piece, t0, t1 = e
        ax.barh(r, (t1 - t0) * scale, left=t0 * scale, height=0.6, color=_COLORS[kind],
                edgecolor="black" if chunk == 0 else "white", linewidth=0.4)
        if not many:
            ax.text((t0 + t1) / 2 * scale, r, f"{mb}", ha="center", va="center", fontsize=6)
    ax.set_yticks(range(p), [f"stage {r}" for r in range(p)])
    ax.invert_yaxis()
    ax.set_xlabel(f"time ({unit})")
    name = result.schedule.name if result.schedule else "schedule"
    ax.set_title(title or f"{name}: step {result.step_time * scale:.3g} {unit}, "
                 f"bubble {result.bubble_fraction:.1%}")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in _COLORS.values()]
    split = result.schedule is not None and result.schedule.split_backward
    labels = ["forward", "backward (input grad)" if split else "backward", "weight grad", "activation send",
              "gradient send"]
    ax.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=5, fontsize=8,
              frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return Path(path)


def plot_memory(result: SimResult, path: str | Path, title: str | None = None) -> Path:
    """Stacked bars: each stage's peak memory by category (GiB)."""
    plt = _plt()
    stats = result.per_stage
    if not stats or not stats[0].peak_memory:
        raise ValueError("the result has no memory model: pass memory=[StageMemory, ...] to simulate()")
    cats = []
    for st in stats:
        for k in st.peak_memory:
            if k not in cats:
                cats.append(k)
    fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(stats) + 3), 4.5))
    bottom = [0.0] * len(stats)
    cmap = plt.get_cmap("tab10")
    for i, c in enumerate(cats):
        vals = [st.peak_memory.get(c, 0) / 2 ** 30 for st in stats]
        ax.bar(range(len(stats)), vals, bottom=bottom, label=c, color=cmap(i % 10))
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xticks(range(len(stats)), [str(r) for r in range(len(stats))])
    ax.set_xlabel("pipeline stage")
    ax.set_ylabel("peak memory (GiB)")
    name = result.schedule.name if result.schedule else "schedule"
    ax.set_title(title or f"{name}: peak memory by category")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return Path(path)
