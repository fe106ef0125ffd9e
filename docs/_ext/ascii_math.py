r"""Turn the plain-text formulas of the shared catalogue (``sqrt(d_k)``, ``sum_j e^{s_j}``) into LaTeX.

The shared catalogue writes its equations as ASCII inside backticks, readable in a terminal. The
catalogue page renders them with MathJax, which needs a handful of rewrites: square roots, big
operators, Greek letters, words set upright, comparison signs. Anything not rewritten is already
valid TeX (subscripts, superscripts, brackets).

The project's own table, ``docs/equations.md``, writes the formulas of its "What" cells as inline
maths (``$a_j (\delta_{ju} - a_u)$``) from the start, since those cells are the page's headings;
:func:`plain_text_formulas` finds a formula written there the plain-text way instead.
"""
from __future__ import annotations

import re

GREEK = ("alpha", "beta", "gamma", "delta", "epsilon", "eta", "theta", "lambda", "mu", "pi",
         "sigma", "tau", "phi", "Phi", "omega", "kappa")
OPERATORS = ("log", "exp", "max", "min", "sin", "cos", "sum", "prod")


def _sqrt(text: str) -> str:
    """``sqrt(x)`` -> ``\\sqrt{x}``, matching the parenthesis that closes the argument."""
    out, i = [], 0
    while (start := text.find("sqrt(", i)) >= 0:
        depth, end = 0, start + 4
        for end in range(start + 4, len(text)):
            depth += {"(": 1, ")": -1}.get(text[end], 0)
            if depth == 0:
                break
        out += [text[i:start], r"\sqrt{", _sqrt(text[start + 5:end]), "}"]
        i = end + 1
    return "".join(out) + text[i:]


def ascii_to_latex(formula: str) -> str:
    """The LaTeX for one backticked formula of the shared catalogue."""
    tex = _sqrt(formula)
    tex = re.sub(r"\b([A-Za-z])_hat\b", r"\\hat{\1}", tex)        # m_hat -> \hat{m}
    # Subscripts of several letters (s_ij, W_DKV) are indices, not words: set them aside so that
    # the rules for words below leave them alone.
    subscripts = []

    def set_aside(match):
        subscripts.append(match.group(1))
        return f"_{{\x00{len(subscripts) - 1}\x00}}"

    tex = re.sub(r"_([A-Za-z0-9]{2,})(?![A-Za-z0-9])", set_aside, tex)
    tex = re.sub(r"\^(\w)\^", r"^{\1}{}^", tex)                      # k^C^T: no double exponent
    tex = tex.replace("<=", r"\le ").replace(">=", r"\ge ").replace("->", r"\to ")
    tex = tex.replace("~", r"\sim ").replace("*", r"\cdot ").replace("%", r"\%")
    tex = re.sub(r"(?<=\w) x (?=\w)", r" \\times ", tex)               # T x T
    tex = re.sub(r"\binf\b", r"\\infty", tex)
    tex = re.sub(r"(?<![\\A-Za-z])eps(?![A-Za-z])", r"\\epsilon", tex)
    names = "|".join(GREEK + OPERATORS)
    tex = re.sub(rf"(?<![\\A-Za-z])({names})(?![A-Za-z])", r"\\\1", tex)
    tex = re.sub(r"\bmod\b", r"\\bmod", tex)
    # Remaining words of two letters or more (Var, softmax, LN, weight bytes) are set upright,
    # a run of them as one text so that the spaces between them survive.
    tex = re.sub(r"(?<![\\A-Za-z])[A-Za-z]{2,}(?: [A-Za-z]{2,})*(?![A-Za-z])",
                 lambda m: rf"\text{{{m.group(0)}}}", tex)
    return re.sub("\x00(\\d+)\x00", lambda m: subscripts[int(m.group(1))], tex)


def markdown_with_math(text: str) -> str:
    """Catalogue prose with each backticked formula turned into inline MyST maths."""
    return re.sub(r"`([^`]+)`", lambda m: f"${ascii_to_latex(m.group(1))}$", text)


# The marks of a formula written the plain-text way. Anywhere, even in backticks (the shared
# catalogue's style, `omega'_r = omega_r / s`): a superscript, a square root, a comparison spelled
# in ASCII, a small Greek letter by name ("Phi" names models). In prose only, since code has them
# too (`mscale_all_dim`): a subscript, ceil and floor, "T x T", integer division, a remainder,
# infinity, big O, a one-letter equation ("g = h") and a count of parameters ("16P").
_GREEK_NAME = rf"(?<![\\A-Za-z])(?:{'|'.join(g for g in GREEK if g.islower())})(?![A-Za-z])"
_FORMULA_ANYWHERE = re.compile(rf"\^|\bsqrt\(|<=|>=|->|{_GREEK_NAME}")
_FORMULA_IN_PROSE = re.compile(
    r"\b[A-Za-z0-9]+_[A-Za-z0-9{(]"      # d_k, W_O, delta_ju, y_{m-1}
    r"|\b(?:ceil|floor)\(|//"
    r"|\b\w+ x \w+\b|\b\w+ % \w+\b"  # T x T, j % p
    r"|\binf\b|\bO\("
    r"|(?<![\w'])[A-Za-z] = |\b\d+[A-Z]\b")


def plain_text_formulas(text: str) -> list[str]:
    """The marks of plain-text formulas in ``text`` outside its ``$...$`` maths (see above): empty
    when every formula is written as inline maths. Backticked code keeps only the marks no code
    has (``reduction="sum"`` and ``mscale_all_dim`` are names, not formulas)."""
    outside_maths = re.sub(r"\$[^$]*\$", " ", text)
    prose = re.sub(r"`[^`]*`", " ", outside_maths)
    return ([m.group(0) for m in _FORMULA_IN_PROSE.finditer(prose)]
            + [m.group(0) for m in _FORMULA_ANYWHERE.finditer(outside_maths)])
