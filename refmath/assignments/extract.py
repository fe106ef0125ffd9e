"""Take only the listed functions from a submitted file, by its syntax tree.

The grader's copy of each submitted file is the given (stubbed) file with each listed function
replaced by the submission's definition of it; everything else the student changed is ignored, so
rewriting the given code (a ``prefill`` that recomputes everything, a check that always passes)
cannot score. A listed function is ``name`` or ``Class.name``; its definition is taken whole,
decorators included, and re-indented to where the given file has it.
"""
from __future__ import annotations

import ast


def _definitions(tree: ast.Module) -> dict[str, ast.AST]:
    """``{qualified name: def node}`` of the module's functions and of its classes' methods."""
    found = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found[node.name] = node
        elif isinstance(node, ast.ClassDef):
            for inner in node.body:
                if isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    found[f"{node.name}.{inner.name}"] = inner
    return found


def _span(node) -> tuple[int, int]:
    """0-based first and last line of a definition, decorators included."""
    first = min([node.lineno] + [d.lineno for d in node.decorator_list])
    return first - 1, node.end_lineno - 1


def _reindent(lines: list[str], old: int, new: int) -> list[str]:
    """Shift lines indented at least ``old`` by ``new - old`` spaces; leave the others (lines of a
    multi-line string that start further left, blank lines) as they are."""
    if old == new:
        return lines
    out = []
    for line in lines:
        lead = len(line) - len(line.lstrip(" "))
        out.append(" " * (lead - old + new) + line[lead:] if line.strip() and lead >= old else line)
    return out


def take_functions(given: str, submitted: str, functions: list[str], path: str):
    """``(text, notes)``: ``given`` with each of ``functions`` replaced by its definition in
    ``submitted``. A function the submission lacks stays as given, and a note says so; a
    submission that does not parse leaves the whole file as given."""
    try:
        theirs = _definitions(ast.parse(submitted, path))
    except SyntaxError as error:
        return given, [f"{path} does not parse (SyntaxError at line {error.lineno}: {error.msg}): "
                       "graded as the starter code"]
    ours = _definitions(ast.parse(given, path))
    submitted_lines = submitted.splitlines()
    lines = given.splitlines()
    notes = []
    # Bottom-up, so that earlier line numbers of the given file stay valid.
    for name in sorted(functions, key=lambda n: -_span(ours[n])[0] if n in ours else 0):
        if name not in ours:
            raise ValueError(f"{path}: the given file has no function {name}")
        if name not in theirs:
            notes.append(f"{path}: no function {name} in the submission: graded as the starter")
            continue
        first, last = _span(theirs[name])
        body = _reindent(submitted_lines[first:last + 1], theirs[name].col_offset,
                         ours[name].col_offset)
        start, end = _span(ours[name])
        lines[start:end + 1] = body
    text = "\n".join(lines) + "\n"
    try:
        ast.parse(text, path)
    except SyntaxError as error:
        return given, [f"{path}: the submitted functions do not fit the given file (SyntaxError at "
                       f"line {error.lineno}: {error.msg}): graded as the starter code"]
    return text, notes
