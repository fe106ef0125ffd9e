"""``refmath._submitted`` in the grader's copy of the library: the submitted functions' own module.

The grader writes this file to ``refmath/_submitted/__init__.py`` of the library a test imports,
beside one module per submitted file holding only the submission's definitions of the listed
functions (:func:`refmath.assignments.extract.submitted_module`). The given module calls
:func:`install` right after each listed definition, so that its own module-level code (a table of
functions, say) sees the submitted one; :func:`install` then

1. runs the submitted module, once, in a namespace of its own whose reads fall through to the
   given module's names, live: a submitted function finds the helpers, classes and imports it was
   written against, but a name it rebinds (``global``) is rebound in its own namespace only;
2. puts each function where the given code looks it up (the module's name, or the method of the
   given class).

The given module's last line calls :func:`freeze`: from then on its names cannot be set or deleted
from outside. This runs in the sandbox, with the standard library only; the grader trusts none of
it.
"""
import os
import sys
import types

__all__ = ["GivenModule", "install", "freeze"]

_LOADED = {}  # relative path -> (namespace, bare classes)


class _Own(dict):
    """The submitted functions' globals: what they set stays here; what they read and do not
    have comes from the given module."""

    def __init__(self, given: dict):
        super().__init__()
        self.given = given

    def __missing__(self, name):
        return self.given[name]


class GivenModule(types.ModuleType):
    """A given module once its submitted functions are installed: read-only from outside."""

    def __setattr__(self, name, value):
        raise AttributeError(f"{self.__name__}.{name} is the grader's given code: it cannot be "
                             "rebound")

    def __delattr__(self, name):
        raise AttributeError(f"{self.__name__}.{name} is the grader's given code: it cannot be "
                             "deleted")


def _load(given: dict, relative: str):
    library = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.path.join(library, *relative.split("/"))
    namespace = _Own(given)
    namespace.update(__name__=relative[:-3].replace("/", "."), __file__=path)
    with open(path, encoding="utf-8") as f:
        source = f.read()
    exec(compile(source, path, "exec", dont_inherit=True), namespace)
    # the bare classes that carried the methods give way to the given ones
    classes = {name: namespace.pop(name) for name, value in list(namespace.items())
               if isinstance(value, type)}
    return namespace, classes


def install(given: dict, relative: str, names: list) -> None:
    """Install ``names`` (``f`` or ``Class.f``) from the submitted module at ``relative``
    (``refmath/_submitted/...``, under this library) into the given module whose globals are
    ``given``."""
    if relative not in _LOADED:
        _LOADED[relative] = _load(given, relative)
    namespace, classes = _LOADED[relative]
    for name in names:
        if "." in name:
            owner, method = name.split(".")
            setattr(given[owner], method, classes[owner].__dict__[method])
        else:
            given[name] = dict.__getitem__(namespace, name)


def freeze(given: dict) -> None:
    """Make the given module read-only from outside (its own ``global`` statements still work)."""
    sys.modules[given["__name__"]].__class__ = GivenModule
