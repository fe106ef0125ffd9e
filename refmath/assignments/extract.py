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

__all__ = ["cpp_functions", "take_functions", "submitted_path", "install_lines", "submitted_module",
           "refused"]


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
    """``(text, notes)``: for C++, ``given`` with each of ``functions`` replaced by its definition
    in ``submitted``; for Python, ``given`` with the lines that install the submitted functions
    from their own module (:func:`submitted_module` writes it, :mod:`refmath._submitted` loads it).
    A function the submission lacks, or that breaks a rule of :func:`refused`, stays as given, and
    a note says so; a Python submission that does not parse leaves the whole file as given (a C++
    one is the compiler's to judge). Whatever ``submitted`` holds, this returns: only a ``given``
    file without one of ``functions`` (the grader's own error) raises; a fuzz test keeps it so."""
    if path.endswith(".cpp"):
        return _take_cpp(given, submitted, functions, path)
    module, taken, notes = submitted_module(given, submitted, functions, path)
    return install_lines(given, path, taken), notes


def submitted_path(path: str) -> str:
    """Where the submitted functions of ``refmath/a/b.py`` live: ``refmath/_submitted/a/b.py``."""
    return "refmath/_submitted/" + path[len("refmath/"):]


def install_lines(given: str, path: str, taken: list[str]) -> str:
    """``given`` with a call installing each of ``taken`` from its own module right after the
    given definition (after its class, for a method), and one freezing the module at its end."""
    if not taken:
        return given
    tree, lines = _parse(given, path), given.rstrip("\n").split("\n")
    where = {}
    for node in tree.body:
        names = ([node.name] if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else
                 [f"{node.name}.{n.name}" for n in node.body
                  if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
                 if isinstance(node, ast.ClassDef) else [])
        for name in names:
            if name in taken:
                where.setdefault(node.end_lineno, []).append(name)
    call = "from refmath._submitted import {0} as _submitted_{0}  # noqa: E402\n_submitted_{0}({1})"
    for end in sorted(where, reverse=True):  # bottom-up: earlier line numbers stay valid
        lines[end:end] = call.format("install", f"globals(), {submitted_path(path)!r}, "
                                                f"{where[end]!r}").split("\n")
    lines += ["", "", "# the submitted functions are installed (see refmath._submitted): read-only "
              "from here on", *call.format("freeze", "globals()").split("\n")]
    return "\n".join(lines) + "\n"


def submitted_module(given: str, submitted: str, functions: list[str], path: str):
    """``(module text, names taken, notes)``: the submission's definitions of ``functions``, each
    alone, at column 0 (a method inside a bare ``class Name:`` line), and nothing else of the file."""
    ours = _definitions(_parse(given, path))
    for name in functions:
        if name not in ours:
            raise ValueError(f"{path}: the given file has no function {name}")
    try:
        theirs = _definitions(_parse(submitted, path))
    except ValueError as error:
        return "", [], [f"{path} does not parse ({error}): graded as the starter code"]
    lines, taken, notes, parts = submitted.splitlines(), [], [], {}
    for name in functions:
        if name not in theirs:
            notes.append(f"{path}: no function {name} in the submission: graded as the starter")
            continue
        node = theirs[name]
        why = refused(node)
        if why:
            notes.append(f"{path}: {name} {why}: refused, graded as the starter")
            continue
        first, last = _span(node)
        body = _reindent(lines[first:last + 1], node.col_offset, 4 if "." in name else 0)
        owner = name.split(".")[0] if "." in name else None  # methods: one bare class per owner
        parts.setdefault(owner or name, [f"class {owner}:"] if owner else []).append("\n".join(body))
        taken.append(name)
    # annotations stay text, never evaluated (as in most given files)
    text = "from __future__ import annotations\n\n\n" + "\n\n\n".join(
        "\n\n".join(part) for part in parts.values()) + "\n"
    try:
        _parse(text, path)
    except ValueError as error:
        return "", [], [f"{path}: the submitted functions cannot stand alone ({error}): graded as "
                        "the starter code"]
    return text, taken, notes


# Names whose use reaches past a function's own values: into a module's or a class's namespace,
# or into code that runs later. A submitted function may not use them (see :func:`refused`).
# (getattr: a name built at run time, "__glob" + "als__", reaches what a dunder attribute would.)
REFLECTIVE_NAMES = {"globals", "vars", "locals", "getattr", "setattr", "delattr", "exec", "eval",
                    "compile", "__import__", "breakpoint"}
REFLECTIVE_MODULES = {"sys", "gc", "ctypes", "inspect", "importlib", "builtins", "types", "marshal",
                      "code", "codeop", "runpy", "pickle", "copyreg", "operator"}


def _literal(node) -> bool:
    """A default value that runs nothing: a constant, a name (a module constant of the given
    file, looked up, not called), a signed number, or a tuple of those."""
    if isinstance(node, (ast.Constant, ast.Name)):
        return True
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        return isinstance(node.operand, ast.Constant)
    return isinstance(node, ast.Tuple) and all(_literal(e) for e in node.elts)


def _plain_annotation(node) -> bool:
    """An annotation made of names, attributes, subscripts, constants and ``|``: no call."""
    return all(isinstance(n, (ast.Name, ast.Attribute, ast.Subscript, ast.Constant, ast.Tuple,
                              ast.List, ast.BinOp, ast.BitOr, ast.expr_context))
               for n in ast.walk(node))


def refused(node) -> str | None:
    """Why the definition ``node`` is refused, or None. Only the body of a submitted function may
    run, and only when the grader's code calls it: nothing runs when it is defined (no decorator,
    no default that is not a literal, no annotation that calls anything), and its body reaches no
    namespace but its own values (no attribute set or deleted on anything but its parameters and
    its own locals, no dunder attribute, none of :data:`REFLECTIVE_NAMES`, no import of
    :data:`REFLECTIVE_MODULES`)."""
    if node.decorator_list:
        return "has a decorator (code that would run when it is defined)"
    arguments = node.args
    if not all(_literal(d) for d in [*arguments.defaults, *(d for d in arguments.kw_defaults if d)]):
        return ("has a default value that is not a literal or a name (code that would run when it is "
                "defined)")
    annotated = [a.annotation for a in [*arguments.posonlyargs, *arguments.args,
                                        *arguments.kwonlyargs, arguments.vararg, arguments.kwarg]
                 if a is not None and a.annotation is not None] + [node.returns]
    if not all(_plain_annotation(a) for a in annotated if a is not None):
        return "has an annotation that calls something (code that would run when it is defined)"
    parameters = {a.arg for a in ast.walk(arguments) if isinstance(a, ast.arg)}
    imported, local = set(), set()
    for inner in ast.walk(node):
        if isinstance(inner, (ast.Import, ast.ImportFrom)):
            module = (inner.module or "") if isinstance(inner, ast.ImportFrom) else ""
            for alias in inner.names:
                top = (module or alias.name).split(".")[0]
                if top in REFLECTIVE_MODULES:
                    return f"imports {top} (not needed to compute an answer)"
                imported.add((alias.asname or alias.name).split(".")[0])
        elif isinstance(inner, ast.Name) and isinstance(inner.ctx, ast.Store):
            local.add(inner.id)
        elif isinstance(inner, ast.arg):
            parameters.add(inner.arg)
        elif isinstance(inner, ast.Name) and inner.id in REFLECTIVE_NAMES:
            return f"uses {inner.id}() (it reaches past the function's own values)"
        elif isinstance(inner, ast.Attribute) and inner.attr.startswith("__") and \
                inner.attr.endswith("__"):
            return f"uses the attribute {inner.attr} (it reaches past the function's own values)"
        elif isinstance(inner, ast.Constant) and isinstance(inner.value, str) and \
                inner.value.startswith("__") and inner.value.endswith("__") and len(inner.value) > 4:
            return f"names {inner.value!r} (it reaches past the function's own values)"
    own = (parameters | local) - imported
    for inner in ast.walk(node):
        if isinstance(inner, ast.Attribute) and isinstance(inner.ctx, (ast.Store, ast.Del)):
            root = inner.value
            while isinstance(root, (ast.Attribute, ast.Subscript)):
                root = root.value
            if not (isinstance(root, ast.Name) and root.id in own):
                shown = ast.unparse(inner)[:60]
                return (f"sets or deletes {shown}, an attribute of something that is not its own "
                        "(only its parameters and its local variables)")
    return None


def _parse(text: str, path: str) -> ast.Module:
    """The syntax tree of ``text``; ``ValueError`` with one line for anything that is not one:
    a syntax error, a NUL byte, nesting too deep for the parser (``RecursionError``, or
    ``MemoryError`` for a long chain of unary operators)."""
    try:
        return ast.parse(text, path)
    except SyntaxError as error:
        raise ValueError(f"SyntaxError at line {error.lineno}: {error.msg}") from None
    except (ValueError, RecursionError, MemoryError, OverflowError) as error:
        raise ValueError(f"{type(error).__name__}: not source text, or nested too deeply for the "
                         "parser") from None
