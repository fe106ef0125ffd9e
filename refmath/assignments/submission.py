"""Read a submission's files as data: no link followed, nothing but regular files, bounded, UTF-8.

A submission folder is the student's: it arrives through ``unzip``, ``tar`` or ``git clone``, any
of which can make a symbolic link (to a classmate's folder, to ``/proc/self/cwd``, where the
grader's own reference lives), a hard link, a FIFO that blocks whoever opens it, or a file of any
size. Only the manifest's paths are opened, each one component at a time from a descriptor of the
folder above it, with ``O_NOFOLLOW``: a link anywhere on the way (the folder itself included) is
refused, never followed, and so is anything that is not a regular file with one name. The bytes
read are capped, and they must be UTF-8 source text.

Any of these refusals is a :class:`SubmissionError` whose one line names the file; the grader
fails every test of that submission with it, and goes on to the next.
"""
from __future__ import annotations

import errno
import os
import stat

from refmath.assignments.text import clean

__all__ = ["MAX_FILE_BYTES", "SubmissionError", "decode", "read_submission"]

MAX_FILE_BYTES = 1 << 20  # a source file of the library is at most a few tens of KiB


class SubmissionError(ValueError):
    """A submission that cannot be read as data: the reason, one line naming the file."""


def _refuse(shown: str, why: str):
    raise SubmissionError(f"{clean(shown)} {why}: refused (submit plain files, not links)")


def _open_folder(path: str, shown: str) -> int:
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as error:
        if error.errno in (errno.ELOOP, errno.ENOTDIR):
            _refuse(shown, "is a symbolic link or not a folder")
        raise SubmissionError(f"{clean(shown)} cannot be opened ({error.strerror})") from None


def _open_in(folder: int, name: str, shown: str, directory: bool) -> int | None:
    """A descriptor of ``name`` in the folder ``folder``, never through a link; None if absent."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK  # a FIFO must not block
    if directory:
        flags |= os.O_DIRECTORY
    try:
        return os.open(name, flags, dir_fd=folder)
    except FileNotFoundError:
        return None
    except OSError as error:
        if error.errno in (errno.ELOOP, errno.ENOTDIR):  # which of the two, from the entry itself
            try:
                link = stat.S_ISLNK(os.stat(name, dir_fd=folder, follow_symlinks=False).st_mode)
            except OSError:
                link = False
            _refuse(shown, "is a symbolic link" if link else "is not a folder")
        raise SubmissionError(f"{clean(shown)} cannot be opened ({error.strerror})") from None


def read_file(root: int, relative: str, shown: str) -> str | None:
    """The text of ``relative`` (``a/b/c.py``) under the folder descriptor ``root``; None if it
    (or a folder on its way) does not exist."""
    parts = relative.split("/")
    folder = os.dup(root)
    try:
        for i, part in enumerate(parts[:-1]):
            inner = _open_in(folder, part, f"{shown}/{'/'.join(parts[:i + 1])}", directory=True)
            if inner is None:
                return None
            os.close(folder)
            folder = inner
        fd = _open_in(folder, parts[-1], f"{shown}/{relative}", directory=False)
    finally:
        os.close(folder)
    if fd is None:
        return None
    name = f"{shown}/{relative}"
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            _refuse(name, "is not a regular file")
        if info.st_nlink != 1:
            _refuse(name, f"is a hard link ({info.st_nlink} names for one file)")
        if info.st_size > MAX_FILE_BYTES:
            raise SubmissionError(f"{clean(name)} is {info.st_size} bytes; a submitted file may be "
                                  f"at most {MAX_FILE_BYTES} bytes")
        data = os.read(fd, MAX_FILE_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_FILE_BYTES:
        raise SubmissionError(f"{clean(name)} is larger than {MAX_FILE_BYTES} bytes")
    return decode(data, name)


def decode(data: bytes, name: str) -> str:
    """``data`` as UTF-8 source text (a leading byte-order mark dropped), or why not."""
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise SubmissionError(f"{clean(name)} is UTF-16 text: save it as UTF-8")
    if b"\0" in data:
        raise SubmissionError(f"{clean(name)} holds a NUL byte (at offset {data.index(0)}): it is "
                              "not source text; save it as UTF-8")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise SubmissionError(f"{clean(name)} is not UTF-8 text (byte 0x{data[error.start]:02x} at "
                              f"offset {error.start}): save it as UTF-8") from None
    return text[1:] if text.startswith("\ufeff") else text


def read_submission(folder: str, paths: list[str]) -> tuple[dict[str, str], list[str]]:
    """``({path: text} of the submitted files, notes)``: each of ``paths`` at its place in the
    student tree (``refmath/attention.py``) or flat (``attention.py``, as Gradescope stores files
    uploaded one by one)."""
    shown = os.path.basename(os.path.normpath(folder)) or folder
    root = _open_folder(folder, shown)
    files, notes = {}, []
    try:
        for path in paths:
            text = read_file(root, path, shown)
            if text is None and "/" in path:
                text = read_file(root, path.rsplit("/", 1)[1], shown)
            if text is None:
                notes.append(f"{path} was not submitted: graded as the starter code")
            else:
                files[path] = text
    finally:
        os.close(root)
    return files, notes
