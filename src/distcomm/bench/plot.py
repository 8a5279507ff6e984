"""--plot: latency and bus bandwidth against size, one row of two panels per op, every engine on each.

matplotlib is optional (the ``bench`` extra) and imported only here, with the Agg backend so the
tool draws without a display. Barrier has no size: its latency per engine goes in the title.
"""

from __future__ import annotations

from typing import Sequence

from .report import format_bytes, machine_line

_STYLES = ({"color": "tab:blue", "marker": "o", "linestyle": "-"},
           {"color": "tab:orange", "marker": "s", "linestyle": "--"},
           {"color": "tab:green", "marker": "^", "linestyle": ":"})


def _size_axis(ax) -> None:
    from matplotlib.ticker import FuncFormatter, LogLocator

    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(LogLocator(base=4))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: format_bytes(x)))
    ax.tick_params(axis="x", labelrotation=45, labelsize=7)
    ax.set_xlabel("message size")
    ax.grid(True, which="major", alpha=0.4)


def _value_axis(ax) -> None:
    from matplotlib.ticker import FuncFormatter

    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
    low, high = ax.get_ylim()
    if high / low < 100:  # two decades or less: label the 2s and 5s between the powers of ten too
        ax.yaxis.set_minor_formatter(FuncFormatter(lambda y, _: f"{y:g}" if f"{y:.1g}"[0] in "25" else ""))
    else:
        ax.yaxis.set_minor_formatter(FuncFormatter(lambda y, _: ""))
    ax.tick_params(axis="y", which="both", labelsize=7)
    ax.grid(True, which="minor", alpha=0.15)


def plot(path: str, ops: Sequence[str], runs: dict[str, list[dict]], meta: dict) -> None:
    """Write a PNG of every op in ``ops`` for every engine in ``runs`` (label -> rows) to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sized = [op for op in ops if op != "barrier"]
    fig, axes = plt.subplots(max(1, len(sized)), 2, figsize=(12, 3.2 * max(1, len(sized))), squeeze=False)
    for (lat, bw), op in zip(axes, sized):
        for style, (label, rows) in zip(_STYLES, runs.items()):
            mine = sorted((r for r in rows if r["op"] == op), key=lambda r: r["size"])
            if not mine:
                continue
            x = [r["size"] for r in mine]
            lat.plot(x, [r["time_us"] for r in mine], label=label, markersize=3, **style)
            bw.plot(x, [r["busbw"] for r in mine], label=label, markersize=3, **style)
        lat.set_ylabel("time per op (µs)")
        lat.set_title(f"{op}: latency")
        bw.set_ylabel("bus bandwidth (GB/s)")
        bw.set_title(f"{op}: busbw" + (" (0 at world size 1)" if meta["world_size"] == 1 else ""))
        for ax in (lat, bw):
            _size_axis(ax)
            if any(y > 0 for line in ax.get_lines() for y in line.get_ydata()):
                _value_axis(ax)
            ax.legend(fontsize=8)
    barrier = [f"{label} {r['time_us']:.1f} µs" for label, rows in runs.items() for r in rows if r["op"] == "barrier"]
    title = (f"distcomm-bench: world size {meta['world_size']}, distcomm backend {meta['backend']}, {meta['dtype']}, "
             f"time = slowest rank's {meta['stat']}\n{machine_line(meta['machine'])}")
    if barrier:
        title += "\nbarrier: " + ", ".join(barrier)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.97 if len(sized) > 2 else 0.9))
    fig.savefig(path, dpi=110)
    plt.close(fig)
