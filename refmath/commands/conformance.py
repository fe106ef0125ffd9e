"""``python -m refmath conformance attention MODULE:FUNCTION --adapter NAME``: anyone's attention
kernel run through the sweep of :mod:`refmath.conformance`; exit status 0 when every applicable
case passes, 1 when any fails, 2 for bad input."""
from __future__ import annotations

import argparse
import sys
import time

from refmath.commands import CommandError
from refmath.conformance import ADAPTERS, check_attention, get_adapter
from refmath.conformance.adapters import resolve_name
from refmath.conformance.case import CONTRACTS
from refmath.conformance.conventions import EMPTY_ROWS
from refmath.conformance.precision import DTYPES
from refmath.conformance.report import print_table, write

__all__ = ["HELP", "DESCRIPTION", "add_arguments", "load_kernel", "run"]

HELP = "run an attention kernel through the conformance sweep against the float64 oracle"
DESCRIPTION = (
    "Run an attention function through a sweep of cases (layouts, Tq != Tk with the causal "
    "alignment named, GQA/MQA, head dims 32-256, causal, windows, padding, decode and paged "
    "decode, inputs that find bugs) and judge each against a float64 oracle with a derived "
    "bound: at most c times the error of a plain implementation in the kernel's dtype, never "
    "below one ulp of the output. Exit status 0 when every applicable case passes, 1 otherwise.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The action ``attention`` and its options."""
    actions = parser.add_subparsers(dest="action", metavar="action", required=True)
    attn = actions.add_parser(
        "attention", help="check an attention kernel",
        description="Check MODULE:FUNCTION (an importable callable) through the adapter that "
        "knows its signature: " + ", ".join(ADAPTERS) + ", or module:Class for an Adapter subclass "
        "of one's own. The numpy adapter calls f(q, k, v, mask=None, scale=None) -> o on NumPy "
        "arrays of the case's dtype, q (B, H, Tq, D), k and v (B, G, Tk, D), mask boolean "
        "(B, 1, Tq, Tk), True where a key is visible, or None; o like q. The sdpa adapter calls "
        "torch.nn.functional.scaled_dot_product_attention's signature; the rest are on the "
        "documentation's page for kernel engineers.")
    attn.add_argument("kernel", metavar="MODULE:FUNCTION",
                      help="the kernel, e.g. torch.nn.functional:scaled_dot_product_attention")
    attn.add_argument("--adapter", required=True, metavar="NAME",
                      help="the calling convention of the kernel: " + ", ".join(ADAPTERS)
                      + ", or module:Class (an Adapter subclass of one's own). numpy: f(q, k, v, "
                      "mask=None, scale=None) -> o, on NumPy arrays q (B, H, T_q, D), k and v "
                      "(B, G, T_k, D) with G dividing H, o like q; mask is None or boolean "
                      "(B, 1, T_q, T_k), True = may attend. sdpa: torch's "
                      "scaled_dot_product_attention. refmath*: refmath.kernels' own")
    attn.add_argument("--quick", action="store_true", help="the quick sweep (a few seconds)")
    attn.add_argument("--long", action="store_true",
                      help="add the T = 32k cases (forward and decode; tens of seconds)")
    attn.add_argument("--dtype", nargs="+", default=None, choices=tuple(DTYPES), metavar="DTYPE",
                      help="the input dtypes (default: float32, or the adapter's first)")
    attn.add_argument("--contract", nargs="+", default=None, choices=CONTRACTS, metavar="CONTRACT",
                      help=f"which contracts ({', '.join(CONTRACTS)}; default: the adapter's)")
    attn.add_argument("--empty-rows", "--masked-rows", dest="masked_rows", choices=EMPTY_ROWS,
                      default=None,
                      help="what a row with no visible key gives: zero (flash-attention), nan (the "
                      "math definition), unmasked (a finite fill added to the scores, as ONNX "
                      "Runtime's -10000), mean-of-v (the scores replaced by one value, as JAX); "
                      "outputs and gradients alike; default: the adapter's convention")
    attn.add_argument("--allow-masked-nan", "--allow-nan-leaks", dest="allow_masked_nan",
                      action="store_true",
                      help="note, rather than fail, a NaN that reaches a row from a key its mask "
                      "hides (mask-adding implementations: NaN + (-inf) = NaN); the sdpa adapter "
                      "declares it")
    attn.add_argument("--allow-past-length-nan", action="store_true",
                      help="note, rather than fail, a NaN from a cache slot past a decode length "
                      "(a defect: only to see the rest of the sweep; the stale-slot cases still "
                      "catch the read)")
    attn.add_argument("--allow-lost-nan", action="store_true",
                      help="note, rather than fail, a NaN the row sees that comes out as a number")
    attn.add_argument("--inline", action="store_true",
                      help="call the kernel on the main thread, with no timeout (libraries whose "
                      "state is bound to the thread that made it)")
    attn.add_argument("--fail-fast", action="store_true", help="stop at the first failed case")
    attn.add_argument("--device", default="cpu", help="where the adapter puts the arrays "
                      "(torch adapters: cpu, cuda, cuda:1 ...)")
    attn.add_argument("--timeout", type=float, default=60.0, metavar="S",
                      help="a call that takes longer fails its case (default 60)")
    attn.add_argument("--report", nargs="+", default=(), metavar="FILE",
                      help="also write the report: .md, .json, or a figure .png/.svg/.pdf")
    attn.add_argument("--show-skips", action="store_true", help="list the cases that do not apply")
    attn.set_defaults(subparser=attn)


def load_kernel(spec: str):
    """The callable named ``MODULE:FUNCTION`` (the function may be dotted: ``mod:Class.method``)."""
    try:
        obj = resolve_name(spec, "the kernel as MODULE:FUNCTION")
    except ValueError as err:
        raise CommandError(str(err)) from None
    if not callable(obj):
        raise CommandError(f"{spec} is a {type(obj).__name__}, not a callable")
    return obj


def run(args: argparse.Namespace) -> int:
    fn = load_kernel(args.kernel)
    try:
        adapter = get_adapter(args.adapter, args.device)
    except (ValueError, TypeError) as err:
        raise CommandError(f"--adapter: {err}") from None
    if args.timeout <= 0:
        raise CommandError(f"--timeout must be positive, got {args.timeout:g}")
    for path in args.report:
        if not str(path).endswith((".md", ".json", ".png", ".svg", ".pdf")):
            raise CommandError(f"--report {path}: the file must end in .md, .json, .png, .svg or .pdf")
    dtypes = tuple(args.dtype) if args.dtype else (adapter.dtypes[0],)
    contracts = tuple(args.contract) if args.contract else adapter.contracts
    bar = _progress()
    start = time.perf_counter()
    conventions = adapter.conventions.replace(
        empty_rows=args.masked_rows,
        masked_nan_may_leak=True if args.allow_masked_nan else None,
        past_length_nan_may_leak=True if args.allow_past_length_nan else None,
        visible_nan_may_vanish=True if args.allow_lost_nan else None)
    results = check_attention(fn, adapter, quick=args.quick, long=args.long, dtypes=dtypes,
                              contracts=contracts, conventions=conventions, timeout=args.timeout,
                              fail_fast=args.fail_fast, inline=args.inline,
                              progress=bar.update if bar else None)
    if bar:
        bar.close()
    seconds = time.perf_counter() - start
    print_table(results, show_skips=args.show_skips)
    print(f"{args.kernel} through the {args.adapter} adapter, {', '.join(dtypes)}: {seconds:.1f} s")
    for path in args.report:
        write(results, path, kernel=args.kernel, adapter=args.adapter, dtypes=list(dtypes),
              quick=args.quick, seconds=round(seconds, 2))
        print(f"wrote {path}")
    if not any(r.status != "skip" for r in results):
        raise CommandError(f"no case applies to the {args.adapter} adapter with {', '.join(dtypes)} "
                           f"and {', '.join(contracts)}: nothing was checked (see --show-skips)")
    return 1 if any(r.status == "fail" for r in results) else 0


class _Bar:
    def __init__(self):
        from tqdm import tqdm

        self.bar = tqdm(total=None, unit="case", file=sys.stderr, leave=False, disable=None)

    def update(self, done, total, result):
        self.bar.total = total
        self.bar.set_postfix_str(result.case.id[-40:], refresh=False)
        self.bar.update(1)

    def close(self):
        self.bar.close()


def _progress():
    try:
        return _Bar()
    except ImportError:  # tqdm is a dependency; without it, no bar
        return None
