"""Run one benchmark command and keep its output as a dated record in benchmarks/results/.

Usage: python benchmarks/record.py [--note TEXT] -- python benchmarks/attention.py --lengths 512 1024

The record is a markdown file named after the date and the script: the date and time (UTC), the
machine (CPU model and count, GPUs), its vector width (the widest of AVX-512, AVX2, NEON the CPU
reports, and the lanes refmath's CPU kernels run with), the load average before and after the
run, the commit, the command, an optional note on the conditions (a shared machine), and the
output exactly as printed (the benchmarks print the machine, its thread count and load first). The
documentation's kernels page shows every record, newest first, as what it is: figures from one run
on one machine, not a live measurement.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def commit() -> str:
    run = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                         text=True)
    return run.stdout.strip() if run.returncode == 0 else "unknown (not a git checkout)"


def machine() -> str:
    """The CPU model and count, and the GPUs where nvidia-smi answers."""
    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                    if line.startswith("model name")), cpu)
    described = f"{cpu}, {os.cpu_count()} CPUs, {platform.system()}"
    if shutil.which("nvidia-smi"):
        gpus = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                              capture_output=True, text=True).stdout.strip().splitlines()
        if gpus:
            described += "; GPU: " + ", ".join(gpus)
    return described


def vector_width() -> str:
    """The CPU's widest vector extension and the float32 lanes refmath's CPU kernels pick."""
    flags = set()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = set(line.split(":", 1)[1].split())
                break
    widest = next((name for flag, name in (("avx512f", "AVX-512 (512-bit)"), ("avx2", "AVX2 (256-bit)"),
                                           ("asimd", "NEON (128-bit)"), ("sse2", "SSE2 (128-bit)"))
                   if flag in flags), "unknown")
    try:
        sys.path.insert(0, str(ROOT))
        from refmath import kernels

        lanes = (f"refmath's CPU kernels: {kernels.cpu_instructions()} by default"
                 if kernels.cpu_available() else "refmath's CPU module is not built")
    except Exception as error:  # a record is still worth keeping without the package
        lanes = f"refmath's CPU kernels: unknown ({type(error).__name__})"
    return f"{widest}; {lanes}"


def load() -> str:
    if not hasattr(os, "getloadavg"):
        return "unknown"
    return "{:.2f} {:.2f} {:.2f}".format(*os.getloadavg())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--note", default="", help="conditions worth knowing (shared machine, load)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the benchmark command, after --")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given (put it after --)")
    now = datetime.datetime.now(datetime.timezone.utc)
    load_before = load()
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if run.returncode != 0:
        sys.stderr.write(run.stdout + run.stderr)
        print(f"the command failed (exit {run.returncode}); nothing recorded", file=sys.stderr)
        return run.returncode
    script = next((Path(part).stem for part in command if part.endswith((".py", ".sh"))), "run")
    path = RESULTS / f"{now:%Y-%m-%d-%H%M}-{script}.md"
    for n in range(2, 100):  # two runs of one script in the same minute keep both records
        if not path.exists():
            break
        path = RESULTS / f"{now:%Y-%m-%d-%H%M}-{script}-{n}.md"
    lines = [f"# {script}, {now:%Y-%m-%d %H:%M} UTC", "",
             f"- machine: {machine()}", f"- vector width: {vector_width()}",
             f"- load average (1, 5, 15 min): {load_before} before, {load()} after",
             f"- command: `{shlex.join(command)}`",
             f"- commit: `{commit()}`"]
    if args.note:
        lines.append(f"- note: {args.note}")
    lines += ["", "```text", run.stdout.rstrip(), "```", ""]
    RESULTS.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines), encoding="utf-8")
    print(f"recorded {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
