"""The comments beside the fields of a class, read from its source: ``{field: comment}``.

``class SDPACache(NamedTuple):`` with the line ``q: np.ndarray  # (..., t_q, d_k)`` gives
``{"q": "(..., t_q, d_k)"}``; a field without a comment gets its type. The API pages show them
where autodoc would say "Alias for field number 0".
"""
from __future__ import annotations

import functools
import importlib
import inspect
import re

FIELD = re.compile(r"^\s+(\w+)\s*:[^#]*#\s*(.+?)\s*$")


@functools.cache
def field_comments(module_name: str, class_name: str) -> dict[str, str]:
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
        source = inspect.getsource(cls)
    except (ImportError, AttributeError, OSError, TypeError):
        return {}
    comments = {}
    for line in source.splitlines()[1:]:
        match = FIELD.match(line)
        if match and match.group(1) not in comments:
            comments[match.group(1)] = _plain(match.group(2))
    # a field with no comment is named with its type, which says more than its position
    for field, annotation in getattr(cls, "__annotations__", {}).items():
        # a string, a ForwardRef (a NamedTuple's under postponed annotations) or a type
        kind = getattr(annotation, "__forward_arg__", annotation)
        kind = kind if isinstance(kind, str) else getattr(kind, "__name__", "")
        comments.setdefault(field, f"The ``{field}`` field" + (f" (``{kind}``)." if kind else "."))
    return comments


def _plain(comment: str) -> str:
    """The comment as reStructuredText that means itself: no emphasis, literal or reference."""
    comment = re.sub(r"([*`|\\])", r"\\\1", comment)
    return re.sub(r"(\w)_(?=\W|$)", r"\1\\_", comment)
