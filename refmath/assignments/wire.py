"""What crosses the sandbox's boundary, and how it is read back without trusting the writer.

A message is one line of JSON (the header), then the raw bytes of the arrays it lists, in order:

.. code-block:: text

    {"arrays": [{"dtype": "<f8", "shape": [2, 3]}, ...], "value": <JSON tree>, ...}\\n
    <2*3*8 bytes> ...

Arrays in the JSON tree are ``{"__array__": i}``, the i-th array after the header; tuples become
lists. Nothing is pickled and nothing is compressed, so a reader can bound what it accepts before
it reads it: the header's length, each dtype (plain numbers only), each shape and the total size.

The grader writes the inputs of a test this way (into the sandbox's read-only folder) and reads
the sandbox's outputs this way, from a pipe, with :func:`read_message` and a deadline. The driver in
the sandbox imports this module from its own copy; it uses only the standard library and NumPy.
"""
from __future__ import annotations

import json
import math
import os
import select
import time

import numpy as np

__all__ = ["DTYPES", "WireError", "pack", "unpack", "encode", "decode", "read_message"]

# The only dtypes that cross: booleans, integers and real floats, little-endian (no objects, no
# strings, no complex numbers: a complex result is not an answer to any question asked here).
DTYPES = {"|b1", "|i1", "<i2", "<i4", "<i8", "|u1", "<u2", "<u4", "<u8", "<f2", "<f4", "<f8"}
MAX_HEADER = 1 << 20  # bytes of the JSON line
MAX_NDIM = 8
MAX_ARRAYS = 4096


class WireError(ValueError):
    """A message that breaks the format or its bounds: the reason, in one line. The readers raise
    nothing else for anything a writer can send (besides ``EOFError`` and ``TimeoutError`` from
    :func:`read_message`); a fuzz test keeps it so."""


def pack(value):
    """``(JSON tree, arrays)`` of ``value``: arrays and NumPy scalars, ``None``, booleans, numbers,
    strings, and lists, tuples and dicts (with string keys) of those."""
    arrays: list[np.ndarray] = []

    def walk(v):
        if isinstance(v, (np.ndarray, np.generic)):
            a = np.asarray(v)
            if a.dtype.newbyteorder("<").str not in DTYPES:
                raise TypeError(f"cannot send an array of dtype {a.dtype} (plain numbers only)")
            arrays.append(a.astype(a.dtype.newbyteorder("<"), order="C", copy=False))
            return {"__array__": len(arrays) - 1}
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        if isinstance(v, (list, tuple)):
            return [walk(x) for x in v]
        if isinstance(v, dict):
            if not all(isinstance(k, str) for k in v):
                raise TypeError("dict keys must be strings")
            if "__array__" in v:
                raise TypeError("'__array__' is reserved")
            return {k: walk(x) for k, x in v.items()}
        raise TypeError(f"cannot send a {type(v).__name__}")
    return walk(value), arrays


def unpack(tree, arrays):
    """The inverse of :func:`pack` (tuples come back as lists)."""
    try:
        return _unpack(tree, arrays)
    except RecursionError:
        raise WireError("the value is nested too deeply") from None


def _unpack(tree, arrays):
    def walk(v):
        if isinstance(v, dict):
            if set(v) == {"__array__"}:
                i = v["__array__"]
                if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < len(arrays):
                    raise WireError(f"array reference {i!r} out of range")
                return arrays[i]
            return {k: walk(x) for k, x in v.items()}
        if isinstance(v, list):
            return [walk(x) for x in v]
        return v
    return walk(tree)


def encode(header: dict, value=None) -> bytes:
    """The message holding ``header`` (a JSON object) and ``value`` (see :func:`pack`)."""
    tree, arrays = pack(value)
    head = {**header, "value": tree,
            "arrays": [{"dtype": a.dtype.str, "shape": list(a.shape)} for a in arrays]}
    return b"".join([json.dumps(head).encode() + b"\n", *(a.tobytes() for a in arrays)])


def _layout(head, max_bytes: int) -> list[tuple[np.dtype, tuple, int]]:
    """The checked ``(dtype, shape, nbytes)`` of each array the header declares."""
    listed = head.get("arrays")
    if not isinstance(listed, list) or len(listed) > MAX_ARRAYS:
        raise WireError(f"the header must list at most {MAX_ARRAYS} arrays")
    layout, total = [], 0
    for spec in listed:
        if not isinstance(spec, dict) or spec.get("dtype") not in DTYPES:
            raise WireError(f"array dtype {str(spec)[:80]} is not a plain number type")
        shape = spec.get("shape")
        if (not isinstance(shape, list) or len(shape) > MAX_NDIM or
                not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape)):
            raise WireError(f"array shape {str(shape)[:80]} is not a list of at most {MAX_NDIM} "
                            "sizes")
        dtype = np.dtype(spec["dtype"])
        # exact (Python integers): a zero anywhere cannot hide a size NumPy would refuse
        if any(n > max_bytes for n in shape):
            raise WireError(f"array shape {str(shape)[:80]} has a size above {max_bytes} entries")
        nbytes = dtype.itemsize * math.prod(shape)
        total += nbytes
        if total > max_bytes:
            raise WireError(f"the arrays declared exceed {max_bytes / 2**20:.0f} MiB")
        layout.append((dtype, tuple(shape), nbytes))
    return layout


def decode(data: bytes, max_bytes: int = 1 << 30):
    """``(header, value)`` of a whole message held in memory (the driver's inputs)."""
    end = data.find(b"\n", 0, MAX_HEADER)
    if end < 0:
        raise WireError("no header line")
    head = _header(data[:end])
    arrays, at = [], end + 1
    for dtype, shape, nbytes in _layout(head, max_bytes):
        if at + nbytes > len(data):
            raise WireError("the message ends inside an array")
        arrays.append(_array(data, dtype, shape, at, nbytes).copy())
        at += nbytes
    return head, unpack(head.get("value"), arrays)


def _array(data: bytes, dtype: np.dtype, shape: tuple, at: int = 0, nbytes: int | None = None):
    nbytes = len(data) - at if nbytes is None else nbytes
    try:
        return np.frombuffer(data, dtype, count=nbytes // dtype.itemsize, offset=at).reshape(shape)
    except (ValueError, MemoryError) as error:
        raise WireError(f"array of shape {str(shape)[:80]} cannot be built: "
                        f"{type(error).__name__}") from None


def _header(line: bytes) -> dict:
    try:
        head = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        raise WireError(f"the header is not JSON ({type(error).__name__})") from None
    if not isinstance(head, dict):
        raise WireError("the header is not a JSON object")
    return head


class _Deadline:
    """Reads from a pipe's descriptor, never past ``deadline`` (``time.monotonic()``)."""

    def __init__(self, fd: int, deadline: float):
        self.fd, self.deadline, self.buffer = fd, deadline, bytearray()

    def _more(self, n: int) -> bool:
        left = self.deadline - time.monotonic()
        if left <= 0 or not select.select([self.fd], [], [], left)[0]:
            raise TimeoutError
        chunk = os.read(self.fd, n)
        self.buffer += chunk
        return bool(chunk)

    def line(self, limit: int) -> bytes:
        while b"\n" not in self.buffer:
            if len(self.buffer) > limit:
                raise WireError(f"the header line is longer than {limit} bytes")
            if not self._more(65536):
                raise EOFError
        end = self.buffer.index(b"\n")
        if end > limit:
            raise WireError(f"the header line is longer than {limit} bytes")
        line = bytes(self.buffer[:end])
        del self.buffer[:end + 1]
        return line

    def exactly(self, n: int) -> bytes:
        while len(self.buffer) < n:
            if not self._more(min(n - len(self.buffer), 1 << 20)):
                raise EOFError
        data = bytes(self.buffer[:n])
        del self.buffer[:n]
        return data


def read_message(fd: int, deadline: float, max_bytes: int):
    """``(header, value)`` read from the pipe ``fd``, checked before each part is read.

    Raises :class:`WireError` for a message that breaks the format or the bounds, ``EOFError``
    when the pipe closes first, ``TimeoutError`` at ``deadline``. At most ``MAX_HEADER +
    max_bytes`` bytes are ever held, whatever the writer sends.
    """
    reader = _Deadline(fd, deadline)
    head = _header(reader.line(MAX_HEADER))
    arrays = []
    for dtype, shape, nbytes in _layout(head, max_bytes):
        arrays.append(_array(reader.exactly(nbytes), dtype, shape))
    return head, unpack(head.get("value"), arrays)
