"""The sweep's report: a table for the terminal (rich where installed, plain text otherwise),
Markdown and JSON files, and a figure of each case's error against its bound (matplotlib).

Every row is one case: its verdict, the output nearest its tolerance, that output's error, the
tolerance of rule (a), the error as a fraction of (a) (at most 1 to pass) and of the a-priori
bound (b), whether the two calls agreed bit for bit, and the reason of a failure or a skip.
"""
from __future__ import annotations

import dataclasses
import json
import math
from collections import Counter

from refmath.conformance import bounds
from refmath.conformance.locate import summary_line

__all__ = ["rows", "summary", "bound_note", "details", "versions", "header", "table", "print_table",
           "markdown", "to_json", "figure", "write"]

HEADER = ("case", "verdict", "output", "error", "tolerance (a)", "err/(a)", "err/(b)", "same bits",
          "reason")


def _fmt(x, spec=".2g") -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    return format(x, spec)


def rows(results) -> list[tuple[str, ...]]:
    """One tuple of strings per case, in the order of :data:`HEADER`."""
    out = []
    for r in results:
        w = r.worst
        b_ratio = None if w is None or not w.apriori else w.error / w.apriori
        det = {None: "-", True: "yes", False: "NO"}[r.deterministic]
        out.append((r.case.id, r.status.upper() if r.status == "fail" else r.status,
                    "-" if w is None else w.name, _fmt(None if w is None else w.error),
                    _fmt(None if w is None else w.tolerance), _fmt(None if w is None else w.ratio),
                    _fmt(b_ratio), det, r.reason))
    return out


def summary(results) -> str:
    """``"57 passed, 2 failed, 7 not applicable"``, with the worst fraction of its tolerance."""
    n = Counter(r.status for r in results)
    ratios = [r.worst.ratio for r in results if r.worst is not None and r.status == "pass"]
    worst = f"; worst passing case at {max(ratios):.2f} of its tolerance" if ratios else ""
    return f"{n['pass']} passed, {n['fail']} failed, {n['skip']} not applicable{worst}"


def bound_note() -> str:
    return (f"tolerance (a) = max(c x error of a plain implementation in the kernel's dtype, "
            f"2u max|ref|) + the oracle's change under the rounding of the scale (and of the saved "
            f"lse, for gradients); c = {bounds.C_FORWARD:g} forward, {bounds.C_BACKWARD:g} "
            f"gradients. (b) a-priori bound from u, D and the visible keys (forward outputs).")


def details(results) -> list[str]:
    """Per failing case: what it is (shapes, mask, lengths, alignment), then per failing output
    the worst row, the split of the failing rows, the worst row's keys and the question it raises
    (:mod:`refmath.conformance.locate`), and the hint when one convention rule is all it breaks."""
    lines = []
    for r in results:
        if r.status != "fail":
            continue
        lines.append(f"{r.case.id}: {r.case.describe()}")
        lines += [f"    {summary_line(w)}" for w in r.where]
        if r.hint:
            lines.append(f"    hint: {r.hint}")
    return lines


def versions(kernel=None) -> dict:
    """The versions that a verdict depends on: Python, NumPy, refmath, and every framework the
    sweep may have called (those already imported), plus the kernel's module's own."""
    import platform
    import sys

    import numpy

    out = {"python": platform.python_version(), "numpy": numpy.__version__}
    try:
        from importlib.metadata import version

        out["refmath"] = version("refmath")
    except Exception:  # noqa: BLE001 - an uninstalled checkout has no metadata
        out["refmath"] = "unknown"
    for name in ("torch", "jax", "jaxlib", "onnxruntime", "tinygrad", "cupy", "flash_attn",
                 "ml_dtypes"):
        mod = sys.modules.get(name)
        if mod is not None:
            out[name] = getattr(mod, "__version__", "unknown")
    if kernel is not None:
        root = str(kernel).split(":")[0].split(".")[0]
        mod = sys.modules.get(root)
        if mod is not None and root not in out:
            out[root] = getattr(mod, "__version__", "unknown")
    return out


def header(results, **meta) -> list[str]:
    """The lines that say what was run: kernel, adapter, dtypes, conventions and versions."""
    conv = next((r.conventions for r in results if r.conventions is not None), None)
    dtypes = meta.get("dtypes") or sorted({r.case.dtype for r in results})
    lines = [f"kernel: {meta.get('kernel', '-')}", f"adapter: {meta.get('adapter', '-')}",
             f"dtypes: {', '.join(dtypes)}"]
    if conv is not None:
        lines.append(f"conventions: {conv.describe()}")
    v = meta.get("versions") or versions(meta.get("kernel"))
    lines.append("versions: " + ", ".join(f"{k} {x}" for k, x in v.items()))
    return lines


def table(results, show_skips: bool = False) -> str:
    """The report as plain text (fixed-width columns), then the failures located."""
    body = [row for row, r in zip(rows(results), results) if show_skips or r.status != "skip"]
    widths = [max(len(h), *(len(row[i]) for row in body)) if body else len(h)
              for i, h in enumerate(HEADER[:-1])]
    lines = ["  ".join(h.ljust(w) for h, w in zip(HEADER[:-1], widths)) + "  reason"]
    for row in body:
        lines.append("  ".join(c.ljust(w) for c, w in zip(row[:-1], widths)) + "  " + row[-1])
    found = details(results)
    if found:
        lines += ["", "Where the failing cases fail:"] + found
    lines += ["", summary(results), bound_note()]
    return "\n".join(lines)


def print_table(results, console=None, show_skips: bool = False) -> None:
    """The table on the terminal: rich's where rich is installed and the output is a terminal,
    else :func:`table` (plain text that a log or a pipe keeps whole)."""
    import sys

    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        Console = None
    if Console is None or (console is None and not sys.stdout.isatty()):
        print(table(results, show_skips))
        return
    console = console or Console()
    t = Table(*HEADER, title="attention conformance", show_lines=False)
    for row, r in zip(rows(results), results):
        if r.status == "skip" and not show_skips:
            continue
        style = {"pass": None, "fail": "bold red", "skip": "dim"}[r.status]
        t.add_row(*row, style=style)
    console.print(t)
    found = details(results)
    if found:
        console.print("Where the failing cases fail:", style="bold")
        for line in found:
            console.print(line, markup=False, highlight=False)
    console.print(summary(results))
    console.print(bound_note(), style="dim")


def markdown(results, title: str = "Attention conformance", **meta) -> str:
    """The report as a Markdown page: what was run (kernel, adapter, dtypes, conventions,
    versions), the summary, the rule, the table with each case's description (skips included),
    and the failures located."""
    head = ["case", "description"] + list(HEADER[1:])
    lines = [f"# {title}", ""] + [f"- {x}" for x in header(results, **meta)]
    lines += ["", summary(results), "", bound_note(), "",
              "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row, r in zip(rows(results), results):
        cells = (row[0], r.case.describe()) + row[1:]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    found = details(results)
    if found:
        lines += ["", "## Where the failing cases fail", ""]
        lines += [f"- {x.strip()}" if not x.startswith("    ") else f"    - {x.strip()}"
                  for x in found]
    return "\n".join(lines) + "\n"


def to_json(results, **meta) -> str:
    """The report as JSON: ``meta`` (kernel, adapter, ...), the rule, and every case."""
    conv = next((r.conventions for r in results if r.conventions is not None), None)
    meta.setdefault("versions", versions(meta.get("kernel")))
    if conv is not None:
        meta.setdefault("conventions", dataclasses.asdict(conv))
    doc = {**meta, "summary": summary(results), "rule": bound_note(),
           "c_forward": bounds.C_FORWARD, "c_backward": bounds.C_BACKWARD,
           "cases": [r.to_dict() for r in results]}
    return json.dumps(doc, indent=2, default=float)


def figure(results, path) -> None:
    """A figure of each applicable case's error as a fraction of its tolerance (a), log scale, the
    line at 1 the pass mark. Ratios are clipped to ``[1e-4, 1e4]`` and the axis covers the clip, so
    every failure is on the plot: one clipped at the top is a red triangle; a failure with no
    error to show (NaN in the wrong place, a wrong shape, a raise) or whose error passes (a row
    that fails its own tolerance, a determinism failure) a red cross just above the line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in results if r.status != "skip"]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.12 * len(shown)), 4.2))
    tiny, top = 1e-4, 1e4
    ratio = [min(max(r.worst.ratio, tiny), top) if r.worst is not None else None for r in shown]
    for i, (r, y) in enumerate(zip(shown, ratio)):
        if y is None or (r.status == "fail" and y <= 1):
            ax.scatter([i], [3.0], marker="x", color="red", s=20)
        elif y >= top:
            ax.scatter([i], [top], marker="^", color="red", s=20)
        else:
            ax.scatter([i], [y], s=12, color="red" if r.status == "fail" else "tab:blue")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_yscale("log")
    ax.set_ylim(tiny / 2, top * 3)
    ax.set_xticks(range(len(shown)))
    ax.set_xticklabels([r.case.id for r in shown], rotation=90, fontsize=5)
    ax.set_ylabel("error / tolerance (a)")
    ax.set_title(summary(results), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)


def write(results, path, **meta) -> None:
    """Write the report to ``path``: ``.md`` Markdown, ``.json`` JSON, ``.png``/``.svg``/``.pdf`` the
    figure."""
    path = str(path)
    if path.endswith(".md"):
        text = markdown(results, **meta)
    elif path.endswith(".json"):
        text = to_json(results, **meta)
    elif path.endswith((".png", ".svg", ".pdf")):
        figure(results, path)
        return
    else:
        raise ValueError(f"the report file must end in .md, .json, .png, .svg or .pdf, got {path!r}")
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
