"""The two pictures `tilertc bench` draws: bench.png (tokens/s/user per system against the
measured roofline) and timeline.png (which SM ran which op when, over one decode step).

matplotlib is imported only here, with the Agg backend (files, no display), because the
benchmark runs on headless GPU machines and nothing else in tilertc needs it.
"""

from __future__ import annotations

from pathlib import Path
from textwrap import shorten
from typing import Any

from tilertc.bench_report import BenchPoint
from tilertc.profile import DEPS_MET, DONE, START, StepProfile, fold_layer

WAIT_COLOUR = "#d9d9d9"


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("the charts need matplotlib: pip install 'tilertc[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_bench(points: list[BenchPoint], title: str, path: str | Path) -> Path:
    """One panel per point: a bar of tokens/s/user per system that ran (the skipped ones are
    named, without a bar) and a dashed line at the roofline the measured ceiling allows."""
    plt = _pyplot()
    fig, axes = plt.subplots(len(points), 1, squeeze=False,
                             figsize=(9, 1.2 + 0.55 * sum(len(p.systems) for p in points)
                                      + 0.9 * len(points)))
    for ax, point in zip(axes[:, 0], points, strict=True):
        rows = point.systems[::-1]  # the first system on top
        rates = [r.timing.tokens_per_s if r.timing else 0.0 for r in rows]
        ax.barh([r.name for r in rows], rates,
                color=["#2b6cb0" if r.name.startswith("tilertc") else "#a0aec0" for r in rows])
        roof = 1e3 / point.roofline_ms
        ax.axvline(roof, color="#c53030", linestyle="--", linewidth=1.2,
                   label=f"measured roofline: {roof:.0f} tokens/s")
        ax.legend(loc="lower right", fontsize=8)
        for y, (r, rate) in enumerate(zip(rows, rates, strict=True)):
            label = (f" {rate:.0f} tok/s, {r.roofline_pct:.0f}% of roofline" if r.timing
                     else f" skipped: {shorten(r.skipped or '', 70, placeholder=' …')}")
            ax.text(rate, y, label, va="center", fontsize=8)
        ax.set_xlim(0, 1.35 * max([roof, *rates]))
        ax.set_xlabel("tokens/s per user (batch 1)")
        ax.set_title(f"context {point.context}, {point.gen} tokens", fontsize=10, loc="left")
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def plot_timeline(profile: StepProfile, step: int, title: str, path: str | Path) -> Path:
    """A broken-bar chart of one step: SMs (CTAs) on y, µs on x; each task is a grey bar while
    it waits for its dependencies, then a bar in its op's colour (layers folded) while it runs."""
    plt = _pyplot()
    stamps = profile.since_start(step) / 1e3  # µs
    kinds = list(dict.fromkeys(fold_layer(op) for op in profile.ops))
    cmap = plt.get_cmap("tab10" if len(kinds) <= 10 else "tab20")
    colour = {k: cmap(i % cmap.N) for i, k in enumerate(kinds)}
    n_ctas = int(profile.ctas.max()) + 1
    fig, ax = plt.subplots(figsize=(14, 2 + n_ctas * 0.06))
    for cta in range(n_ctas):
        mine = [i for i in range(len(profile.ops)) if profile.ctas[i] == cta]
        if not mine:
            continue
        s = stamps[mine]
        ax.broken_barh(list(zip(s[:, START], s[:, DEPS_MET] - s[:, START], strict=True)),
                       (cta - 0.4, 0.8), facecolors=WAIT_COLOUR)
        ax.broken_barh(list(zip(s[:, DEPS_MET], s[:, DONE] - s[:, DEPS_MET], strict=True)),
                       (cta - 0.4, 0.8),
                       facecolors=[colour[fold_layer(profile.ops[i])] for i in mine])
    handles = [plt.Rectangle((0, 0), 1, 1, color=colour[k]) for k in kinds]
    handles.append(plt.Rectangle((0, 0), 1, 1, color=WAIT_COLOUR))
    ax.legend(handles, [*kinds, "waiting for dependencies"], loc="upper left",
              bbox_to_anchor=(1.0, 1.0), fontsize=8)
    ax.set_ylim(n_ctas - 0.5, -0.5)
    ax.yaxis.get_major_locator().set_params(integer=True)
    ax.set_xlim(0, stamps[:, DONE].max())
    ax.set_xlabel("µs since the step's first task started")
    ax.set_ylabel("SM (CTA)")
    ax.set_title(title, fontsize=10, loc="left")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
