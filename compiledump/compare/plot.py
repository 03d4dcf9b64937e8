"""``--plot``: rel_diff and norm_diff per prefill key and logit margins per decode step (needs matplotlib)."""

from __future__ import annotations

from pathlib import Path

from .report import Report
from .text import where


class PlotUnavailable(Exception):
    """``--plot`` was asked for but matplotlib is not installed."""


def write_plot(report: Report, path: str | Path) -> None:
    """Draw rel_diff and norm_diff per prefill key (log scale, each key's thresholds) and the reference and run
    top-1/top-2 margins per decode step, argmax flips marked. Needs matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotUnavailable("--plot needs matplotlib: pip install matplotlib (or compiledump[plot])") from None
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(12, 8))
    for pair in report.pairs:
        rank = pair.rank
        records = [record for record in pair.keys if record.floats is not None and record.phase == "prefill"]
        if records:
            values = [max(record.floats.rel_diff, 1e-18) for record in records]
            top.semilogy(range(len(records)), values, marker=".", label=f"rel_diff rank {rank}")
            norms = [max(record.floats.norm_diff or 0.0, 1e-18) for record in records]
            top.semilogy(range(len(records)), norms, marker="x", linestyle="--", label=f"norm_diff rank {rank}")
            if rank == report.pairs[0].rank:  # each key's thresholds (they follow its precision class)
                for name, style in (("rel_diff", ":"), ("norm_diff", "-.")):
                    limits = [getattr(record.limits, name) for record in records]
                    top.step(range(len(records)), limits, where="mid", color="gray", linestyle=style,
                             label=f"{name} threshold")
            bad = [(index, value) for index, (record, value) in enumerate(zip(records, values)) if record.divergent]
            if bad:
                top.scatter(*zip(*bad), color="red", zorder=3)
            first_bad = next((index for index, record in enumerate(records) if record.divergent), None)
            if first_bad is not None:
                top.axvline(first_bad, color="red", linestyle="--", linewidth=0.8)
            ticks = [(index, str(record.layer)) for index, record in enumerate(records)
                     if record.layer is not None and (index == 0 or records[index - 1].layer != record.layer)]
            if ticks and len(report.pairs) == 1:
                stride = max(1, len(ticks) // 40)
                top.set_xticks([tick for tick, _ in ticks[::stride]], [label for _, label in ticks[::stride]])
        steps = [record for record in pair.keys if record.margin_analysis and record.argmax_equal is not None]
        for tag in sorted({record.tag for record in steps}):
            tagged = [record for record in steps if record.tag == tag]
            xs = [record.step for record in tagged]
            bottom.plot(xs, [record.floats.margins.ref.margin for record in tagged], label=f"REF {tag} rank {rank}")
            bottom.plot(xs, [record.floats.margins.run.margin for record in tagged], linestyle="--",
                        label=f"RUN {tag} rank {rank}")
            diverged = next((record.step for record in tagged if record.divergent), None)
            if diverged is not None:
                bottom.axvline(diverged, color="red", linestyle="--", linewidth=0.8)
            flips = [(record.step, record.floats.margins.ref.margin) for record in tagged if not record.argmax_equal]
            if flips:
                bottom.scatter(*zip(*flips), color="red", marker="x", zorder=3, label="argmax flip")
    top.set_title("prefill: rel_diff and norm_diff per key (x ticks: layer)")
    top.set_ylabel("rel_diff, norm_diff")
    top.legend(loc="upper left", fontsize="small")
    bottom.set_title("decode: top-1 minus top-2 logit per step")
    bottom.set_xlabel("decode step")
    bottom.set_ylabel("margin")
    if bottom.lines:
        bottom.legend(loc="upper right", fontsize="small")
    first, cause = report.first_divergence, report.root_cause
    title = "no divergence" if first is None else f"first divergence: {first.key}{where(first)}"
    if cause is not None:
        title += f"; likely root cause: {cause.key} ids differ"
    figure.suptitle(title, fontsize="medium")
    figure.tight_layout(rect=(0, 0, 1, 0.97))
    figure.savefig(path, dpi=100)
    plt.close(figure)
