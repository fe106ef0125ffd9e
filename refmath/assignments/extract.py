"""Take only the listed functions from a submitted file, by its syntax tree.

The grader's copy of each submitted file is the given (stubbed) file with each listed function
replaced by the submission's definition of it; everything else the student changed is ignored, so
rewriting the given code (a ``prefill`` that recomputes everything, a check that always passes)
cannot score. In Python a listed function is ``name`` or ``Class.name``; its definition is taken
whole, decorators included, and re-indented to where the given file has it. In C++ (``.cpp``) it
is a function defined at file scope, from the line of its name to its closing brace, found by
matching braces outside comments, strings and character literals.
"""
from __future__ import annotations

import ast
import re


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


def _blank_cpp(text: str) -> str:
    """``text`` with comments, string and character literals replaced by spaces (newlines kept),
    so that braces and parentheses in them do not count."""
    out, i, n = list(text), 0, len(text)
    while i < n:
        two = text[i:i + 2]
        if two in ("//", "/*"):
            end = text.find("\n" if two == "//" else "*/", i + 2)
            end = n if end < 0 else end + (0 if two == "//" else 2)
        elif text[i] in "\"'":
            end = i + 1
            while end < n and text[end] != text[i] and text[end] != "\n":
                end += 2 if text[end] == "\\" else 1
            end = min(end + 1, n)
        else:
            i += 1
            continue
        for j in range(i, end):
            if out[j] != "\n":
                out[j] = " "
        i = end
    return "".join(out)


def cpp_functions(text: str) -> dict[str, tuple[int, int]]:
    """``{name: (first line, last line)}``, 0-based, of the functions defined at file scope: an
    opening brace at depth 0 whose statement holds ``name(`` (not ``struct``, ``class``,
    ``namespace``, ``enum``, ``union`` or an initialiser)."""
    # preprocessor lines out of the way too: statements then end only at ';', '{' or '}'
    blank = "\n".join(" " * len(line) if line.lstrip().startswith("#") else line
                      for line in _blank_cpp(text).split("\n"))
    found, depth, start, statement_start = {}, 0, None, 0
    for i, ch in enumerate(blank):
        if ch == "{":
            if depth == 0:
                statement = blank[statement_start:i]
                named = re.findall(r"([A-Za-z_]\w*)\s*\(", statement)
                keyword = re.match(r"\s*(struct|class|namespace|enum|union)\b", statement)
                if named and not keyword and not statement.rstrip().endswith("="):
                    first = text.count("\n", 0, statement_start + len(statement)
                                       - len(statement.lstrip()))
                    start = (named[0], first)
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                if start is not None:
                    found[start[0]] = (start[1], text.count("\n", 0, i))
                start, statement_start = None, i + 1
        elif ch == ";" and depth == 0:
            statement_start = i + 1
    return found


def _take_cpp(given: str, submitted: str, functions: list[str], path: str):
    ours, theirs = cpp_functions(given), cpp_functions(submitted)
    lines, submitted_lines, notes = given.splitlines(), submitted.splitlines(), []
    for name in sorted(functions, key=lambda n: -ours[n][0] if n in ours else 0):
        if name not in ours:
            raise ValueError(f"{path}: the given file has no function {name}")
        if name not in theirs:
            notes.append(f"{path}: no function {name} in the submission: graded as the starter")
            continue
        first, last = theirs[name]
        start, end = ours[name]
        lines[start:end + 1] = submitted_lines[first:last + 1]
    return "\n".join(lines) + "\n", notes


def take_functions(given: str, submitted: str, functions: list[str], path: str):
    """``(text, notes)``: ``given`` with each of ``functions`` replaced by its definition in
    ``submitted``. A function the submission lacks stays as given, and a note says so; a Python
    submission that does not parse leaves the whole file as given (a C++ one is the compiler's to
    judge)."""
    if path.endswith(".cpp"):
        return _take_cpp(given, submitted, functions, path)
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
