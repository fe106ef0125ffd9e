"""The kernels page: the header comment of each CUDA and C++ source, read at build time.

Each kernel file opens with a comment that says what it does and, for the CUDA ladder, what
changes from the previous version, why it is faster and what it leaves for the next. The page
shows those comments as written, so a new ``flash_vN.cu`` appears without editing the docs.
"""
from __future__ import annotations

import re
from pathlib import Path

from lesson_pages import write_if_changed


def header_comment(source: Path) -> list[str]:
    """The leading ``//`` comment of a source file, without the slashes."""
    lines = []
    for line in source.read_text(encoding="utf-8").splitlines():
        if not line.startswith("//"):
            break
        lines.append(line[2:].removeprefix(" "))
    return lines


def _version(path: Path) -> tuple[int, str]:
    match = re.search(r"_v(\d+)", path.stem)
    return (int(match.group(1)) if match else 0, path.name)


def kernel_sources(root: Path) -> dict[str, list[Path]]:
    """The sources shown, by group: the FlashAttention ladder, the other CUDA files, the C++ ones."""
    cuda = root / "csrc" / "cuda"
    ladder = sorted(cuda.glob("flash_v*.cu"), key=_version)
    return {
        "The FlashAttention forward ladder (CUDA)": ladder,
        "The other CUDA kernels": sorted(set(cuda.glob("*.cu")) - set(ladder)),
        "The C++ kernels": sorted((root / "csrc").glob("*.cpp")),
    }


def render_ladder(root: Path) -> str:
    """One section per source file: its first comment line as the title, the rest verbatim."""
    out = []
    for group, sources in kernel_sources(root).items():
        if not sources:
            continue
        out += [f"## {group}", ""]
        for source in sources:
            comment = header_comment(source)
            if not comment:
                continue
            title = comment[0].rstrip(".")
            body = "\n".join(comment[1:]).strip("\n")
            out += [f"### `{source.relative_to(root)}`: {title}", ""]
            if body:
                out += ["```text", body, "```", ""]
    return "\n".join(out)


def write_ladder(root: Path, target: Path) -> None:
    write_if_changed(target, render_ladder(root))
