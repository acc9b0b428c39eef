"""The report's figures, drawn with matplotlib's object API on the Agg canvas (no pyplot, no
display, no global backend state) and saved as PNGs beside the page.

Per shape: the speedup over the rule per bucket, time against num_tokens with the floors and
the roofline fraction, which kernel family wins where, and how the search converged; for the
table: where the tuning time went.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import LogNorm, Normalize
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from moetune.tuner.report_data import ReportData, RowStatus, ShapeView, duration

DPI = 100
_STATUS_STYLE = {  # face colour, hatch
    RowStatus.SERVED: ("#2f6db3", ""),
    RowStatus.RULE_KEPT: ("#8fb3dc", ""),
    RowStatus.IMPORTED: ("#bbbbbb", ""),
    RowStatus.STALE: ("#e0a030", "//"),
    RowStatus.INVALID: ("#c0392b", "xx"),
}


@dataclasses.dataclass(frozen=True)
class Picture:
    """A PNG written beside the page: its file name, alt text and caption."""

    file: str
    alt: str
    caption: str


def draw_figures(data: ReportData, directory: Path) -> dict[str, list[Picture]]:
    """Write every figure into ``directory``; returns them by shape slug (``""``: the table's)."""
    out: dict[str, list[Picture]] = {"": []}
    for shape in data.shapes:
        name = shape.name
        pictures = [
            _save(_speedup(shape), directory, f"speedup-{shape.slug}.png",
                  f"{name}: speedup over the rule per bucket",
                  "Speedup of the winner over the rule per bucket (bars from 1x; whiskers: the "
                  "speedup's confidence interval from the confirmation rounds; markers: the "
                  "other rule variants). Hatched, labelled bars: stale or invalid rows."),
            _save(_times(shape), directory, f"time-{shape.slug}.png",
                  f"{name}: time against num_tokens with floors",
                  "Time per MoE call against num_tokens (log-log): the winner (band: p20-p80), "
                  "the rule and, where ceilings are known, the HBM and compute floors; below, "
                  "the fraction of the roofline each bucket reaches."),
            _save(_families(shape), directory, f"families-{shape.slug}.png",
                  f"{name}: kernel families per bucket",
                  "Which kernel family wins where: each family's best stored trial over the "
                  "bucket's best trial (1.00 = the fastest), the table's winner boxed."),
        ]
        if any(b.trials for b in shape.buckets):
            pictures.append(_save(
                _convergence(shape), directory, f"convergence-{shape.slug}.png",
                f"{name}: search convergence",
                "Best time the search knew, over its final best, against the timed trials "
                "after the rule's variants (at 0: the rule's speed); where a line reaches 1, "
                "later trials found nothing faster. Search timings, not the confirmation's."))
        out[shape.slug] = pictures
    if any(b.tuning_s for b in data.buckets):
        out[""].append(_save(
            _tuning_time(data), directory, "tuning-time.png", "Tuning wall time per bucket",
            "Wall time per bucket and shape; above each bar: timed trials / all stored trials "
            "(the rest pruned, failed or wrong). A job writes each bucket's trials when the "
            "bucket is done, so a bucket's time runs from the previous write of its run (the "
            "first bucket's from the run's start, job start-up included) to its own; with "
            "--gpus, buckets overlap."))
    return out


def _save(fig: Figure, directory: Path, name: str, alt: str, caption: str) -> Picture:
    FigureCanvasAgg(fig)
    fig.savefig(directory / name, dpi=DPI, metadata={"Software": None})
    return Picture(name, alt, caption)


def _ticks(shape: ShapeView) -> tuple[list[int], list[str]]:
    return list(range(len(shape.buckets))), [str(b.num_tokens) for b in shape.buckets]


def _speedup(shape: ShapeView) -> Figure:
    fig = Figure(figsize=(9, 3.9), layout="constrained")
    ax = fig.add_subplot()
    x, labels = _ticks(shape)
    bars = [b.row.speedup for b in shape.buckets if b.row.speedup] or [1.0]
    # Another variant far slower than the rule (the torch loop beside vLLM's kernel) would
    # flatten the bars: such markers sit at the top edge with their value.
    furthest = max((v.speedup or 0.0 for b in shape.buckets for v in b.others), default=0.0)
    cap = max(bars) * 1.5 if furthest > max(bars) * 1.5 else None
    tops = []
    for i, b in zip(x, shape.buckets):
        colour, hatch = _STATUS_STYLE[b.status]
        s = b.row.speedup
        if s is None:
            ax.text(i, 1.0, "no\ntime", ha="center", va="bottom", fontsize=7, color="#666")
            continue
        ax.bar(i, s - 1.0, bottom=1.0, color=colour, hatch=hatch, edgecolor="#333",
               linewidth=0.5, width=0.7)
        if b.rule and b.rule.ratio_lo and b.rule.ratio_hi:
            ax.vlines(i, b.rule.ratio_lo, b.rule.ratio_hi, color="#111", linewidth=1.2)
        for v in b.others:
            if not v.speedup:
                continue
            if cap and v.speedup > cap:
                ax.plot(i, cap, marker="^", markersize=6, color="#555")
                ax.text(i + 0.12, cap, f"{v.speedup:.2f}x", fontsize=7, va="center",
                        color="#555")
                tops.append(cap)
            else:
                ax.plot(i, v.speedup, marker="_", markersize=12, markeredgewidth=1.6,
                        color="#555")
                tops.append(v.speedup)
        if b.status.faulty:
            top = max(s, 1.0, b.rule.ratio_hi if b.rule and b.rule.ratio_hi else 0.0)
            ax.annotate(b.status.value, (i, top), xytext=(0, 3), textcoords="offset points",
                        ha="center", va="bottom", fontsize=7, color=colour, fontweight="bold")
        tops.append(s)
    ax.axhline(1.0, color="#111", linewidth=0.8)
    hi = max(tops, default=1.1)
    lo = min(tops + [1.0])
    ax.set_ylim(min(0.97, lo - 0.02), hi + (hi - min(lo, 1.0)) * 0.15 + 0.02)
    ax.set_xticks(x, labels)
    ax.set_xlabel("bucket (num_tokens)")
    ax.set_ylabel("speedup over the rule (x)")
    rule = _short(next((b.rule.label for b in shape.buckets if b.rule), "the rule"))
    ax.set_title(f"{shape.name}: winner's speedup over the rule ({rule})", fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    present = sorted({b.status for b in shape.buckets}, key=list(RowStatus).index)
    handles = [Patch(facecolor=_STATUS_STYLE[s][0], hatch=_STATUS_STYLE[s][1], edgecolor="#333",
                     label=s.value) for s in present]
    handles.append(ax.vlines([], 0, 0, color="#111", label="speedup interval (confirmation)"))
    others = list(dict.fromkeys(_short(v.label) for b in shape.buckets for v in b.others))
    if others:
        name = others[0] if len(others) == 1 else "other rule variants"
        handles.append(ax.plot([], [], marker="_", markersize=12, markeredgewidth=1.6,
                               linestyle="", color="#555", label=f"speedup over {name}")[0])
    fig.legend(handles=handles, fontsize=7, loc="outside lower center", ncols=len(handles))
    return fig


def _times(shape: ShapeView) -> Figure:
    floors = any(b.floors for b in shape.buckets)
    fig = Figure(figsize=(9, 5.6 if floors else 4.2), layout="constrained")
    axes = (fig.subplots(2, 1, sharex=True, height_ratios=(3, 1.4)) if floors
            else [fig.add_subplot()])
    ax = axes[0]
    m = [b.num_tokens for b in shape.buckets]

    def line(values: list[float | None], **style: object) -> None:
        pts = [(t, v) for t, v in zip(m, values) if v]
        if pts:
            ax.plot(*zip(*pts), **style)

    winner = [b.row.median_us for b in shape.buckets]
    line(winner, marker="o", markersize=3.5, color="#2f6db3", label="winner")
    band = [(b.num_tokens, b.row.p20_us, b.row.p80_us) for b in shape.buckets
            if b.row.p20_us and b.row.p80_us]
    if band:
        t, lo, hi = zip(*band)
        ax.fill_between(t, lo, hi, color="#2f6db3", alpha=0.2, linewidth=0)
    line([b.row.baseline_us for b in shape.buckets], marker="s", markersize=3, color="#d35400",
         linestyle="--", label="the rule (where tuned)")
    labels = dict.fromkeys(v.label for b in shape.buckets for v in b.others)
    for n, label in enumerate(labels):
        line([next((v.median_us for v in b.others if v.label == label), None)
              for b in shape.buckets], marker="^", markersize=3, linestyle=":",
             color=["#7f8c8d", "#8e44ad", "#16a085"][n % 3], label=_short(label))
    # The y range follows the measured times and the roofline; a compute floor far below
    # (decode sizes) runs off the bottom instead of squashing the times into one line.
    shown = [v for v in winner if v] + [b.row.baseline_us for b in shape.buckets
                                        if b.row.baseline_us]
    shown += [v.median_us for b in shape.buckets for v in b.others if v.median_us]
    if floors:
        roof = [(b.num_tokens, b.floors.roofline_us) for b in shape.buckets
                if b.floors and b.floors.roofline_us]
        shown += [r for _, r in roof] + [b.floors.hbm_us for b in shape.buckets if b.floors]
        bottom = min(shown) / 2
        if roof:
            t, r = zip(*roof)
            ax.fill_between(t, [bottom] * len(r), r, color="#999", alpha=0.15, linewidth=0,
                            label="below the roofline (unreachable)")
        line([b.floors.hbm_us if b.floors else None for b in shape.buckets], color="#444",
             linestyle=(0, (4, 2)), linewidth=1, label="HBM floor")
        line([b.floors.compute_us if b.floors else None for b in shape.buckets], color="#444",
             linestyle="-.", linewidth=1, label="compute floor")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    if shown:
        ax.set_ylim(min(shown) / 2, max(shown) * 1.6)
    ax.set_ylabel("time per MoE call (us)")
    ax.set_title(f"{shape.name}: time against num_tokens", fontsize=10)
    ax.grid(which="both", alpha=0.25)
    _legend(ax)
    if floors:
        frac = axes[1]
        for attr, style in (("roofline", dict(color="#2f6db3", marker="o", label="winner")),
                            ("rule_roofline", dict(color="#d35400", marker="s", linestyle="--",
                                                   label="the rule"))):
            pts = [(b.num_tokens, getattr(b, attr)) for b in shape.buckets if getattr(b, attr)]
            if pts:
                frac.plot(*zip(*pts), markersize=3.5, **style)
        frac.axhline(1.0, color="#111", linewidth=0.8)
        frac.set_ylim(0, max(1.1, *(b.roofline or 0 for b in shape.buckets)) * 1.05)
        frac.set_ylabel("roofline fraction")
        frac.grid(alpha=0.25)
        _legend(frac)
    axes[-1].set_xticks(m, [str(t) for t in m], fontsize=7, rotation=60)
    axes[-1].minorticks_off()
    axes[-1].set_xlabel("num_tokens (bucket)")
    return fig


def _legend(ax: Axes) -> None:
    """A legend beside ``ax``, if anything was drawn on it (a shape whose rows have no times,
    such as imported ones, draws nothing)."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))


def _short(label: str) -> str:
    """A legend's name for a rule variant: without its tuned file's long name."""
    words = [w for w in label.split(" ") if not w.endswith(".json")]
    return " ".join(words)[:60]


def _families(shape: ShapeView) -> Figure:
    """Rows: kernel families; columns: buckets; colour: the family's best stored trial over the
    bucket's best (1 = fastest); the winner's cell boxed."""
    families = sorted({t["kernel"] for b in shape.buckets for t in b.trials}
                      | {b.row.kernel for b in shape.buckets})
    fig = Figure(figsize=(9, max(2.4, 1.2 + 0.32 * len(families))), layout="constrained")
    ax = fig.add_subplot()
    norm = Normalize(1.0, 2.0)
    cmap = _cmap()
    for col, b in enumerate(shape.buckets):
        bests = b.family_bests()
        best = min(filter(None, bests.values()), default=None)
        for row, family in enumerate(families):
            mine = bests.get(family)
            tried = family in bests
            if mine and best:
                ratio = mine / best
                ax.add_patch(Rectangle((col, row), 1, 1, color=cmap(norm(min(ratio, 2.0)))))
                ax.text(col + 0.5, row + 0.5, f"{ratio:.2f}", ha="center", va="center",
                        fontsize=6, color="white" if ratio < 1.35 else "#222")
            else:
                ax.add_patch(Rectangle((col, row), 1, 1, color="#eeeeee"))
                ax.text(col + 0.5, row + 0.5, "x" if tried else "", ha="center", va="center",
                        fontsize=6, color="#999")
            if family == b.row.kernel:
                ax.add_patch(Rectangle((col + 0.04, row + 0.06), 0.92, 0.88, fill=False,
                                       edgecolor="#111", linewidth=1.6))
    ax.set_xlim(0, len(shape.buckets))
    ax.set_ylim(len(families), 0)
    ax.set_xticks([i + 0.5 for i in range(len(shape.buckets))],
                  [str(b.num_tokens) for b in shape.buckets], fontsize=7)
    ax.set_yticks([i + 0.5 for i in range(len(families))], families, fontsize=7)
    ax.set_xlabel("bucket (num_tokens); boxed: the table's winner; x: tried, none passed; "
                  "blank: not tried", fontsize=8)
    ax.set_title(f"{shape.name}: best trial of each family / best trial of the bucket",
                 fontsize=10)
    ax.tick_params(length=0)
    fig.colorbar(_mappable(norm, cmap), ax=ax, shrink=0.9, pad=0.01,
                 label="x slower (2 = 2x or more)")
    return fig


def _cmap():  # type: ignore[no-untyped-def]
    from matplotlib import colormaps

    return colormaps["viridis"]


def _mappable(norm: Normalize, cmap):  # type: ignore[no-untyped-def]
    from matplotlib.cm import ScalarMappable

    return ScalarMappable(norm=norm, cmap=cmap)


def _convergence(shape: ShapeView) -> Figure:
    fig = Figure(figsize=(9, 3.8), layout="constrained")
    ax = fig.add_subplot()
    cmap = _cmap()
    tokens = [b.num_tokens for b in shape.buckets]
    norm = LogNorm(min(tokens), max(max(tokens), min(tokens) + 1))
    top = 1.0
    for b in shape.buckets:
        best = b.search_curve()
        final = best[-1]
        if not final:
            continue
        pts = [(n, v / final) for n, v in enumerate(best) if v]
        top = max(top, pts[0][1])
        ax.plot(*zip(*pts), drawstyle="steps-post", color=cmap(norm(b.num_tokens)),
                linewidth=1.2)
    ax.set_ylim(0.99, min(top, 3.0) * 1.03 + 0.01)
    ax.set_xlabel("timed trials after the rule's variants (0: the rule; pruned configurations "
                  "cost no trial)")
    ax.set_ylabel("best so far / final best")
    ax.set_title(f"{shape.name}: search convergence per bucket", fontsize=10)
    ax.grid(alpha=0.25)
    fig.colorbar(_mappable(norm, cmap), ax=ax, pad=0.01, label="bucket (num_tokens)")
    return fig


def _tuning_time(data: ReportData) -> Figure:
    shapes = [s for s in data.shapes if s.tuning_s()]
    fig = Figure(figsize=(9, 0.6 + 1.7 * len(shapes)), layout="constrained")
    axes = fig.subplots(len(shapes), 1, squeeze=False)[:, 0]
    for ax, shape in zip(axes, shapes):
        x, labels = _ticks(shape)
        secs = [b.tuning_s or 0.0 for b in shape.buckets]
        ax.bar(x, secs, color="#2f6db3", width=0.7)
        for i, (s, b) in enumerate(zip(secs, shape.buckets)):
            ok = sum(t["status"] == "ok" for t in b.trials)
            ax.text(i, s, f"{ok}/{len(b.trials)}", ha="center", va="bottom", fontsize=6)
        ax.set_xticks(x, labels, fontsize=7)
        ax.set_ylim(0, max(secs) * 1.25 if max(secs) else 1)
        ax.set_ylabel("seconds", fontsize=8)
        ax.set_title(f"{shape.name}: {duration(shape.tuning_s())} over "
                     f"{len(shape.buckets)} buckets", fontsize=9, loc="left")
        ax.grid(axis="y", alpha=0.3)
    axes[-1].set_xlabel("bucket (num_tokens)")
    return fig
