"""The sandbox and its boundary: the wire format's bounds, the extraction of listed functions, and
what each sandbox mode confines (processes, files, network, the user mode's refusal)."""
from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import pytest

from refmath.assignments import sandbox as sandboxes
from refmath.assignments import wire
from refmath.assignments.extract import install_lines, submitted_module, submitted_path, take_functions
from refmath.assignments.grade import INSTALLER
from refmath.assignments.manifest import Limits

LIMITS = Limits(wall_s=20, cpu_s=10, memory_mb=1024, output_kb=64)
EMPTY_LIBRARY = {"refmath/__init__.py": ""}


# ---- the wire format ----------------------------------------------------------------------------

def test_values_cross_the_wire_unchanged():
    value = {"a": np.arange(6.0).reshape(2, 3), "scalar": np.float64(1.5), "zero_d": np.array(3),
             "flags": np.array([True, False]), "f32": np.ones((2, 0), np.float32),
             "nested": [1, 2.5, None, "s", (np.int8(-1), {"x": True})]}
    head, back = wire.decode(wire.encode({"status": "ok"}, value))
    assert head["status"] == "ok"
    assert back["a"].shape == (2, 3) and np.array_equal(back["a"], value["a"])
    assert back["scalar"].shape == () and back["scalar"] == 1.5
    assert back["zero_d"].shape == () and back["zero_d"].dtype == np.int64
    assert back["flags"].dtype == np.bool_ and back["f32"].shape == (2, 0)
    assert back["nested"][:4] == [1, 2.5, None, "s"] and back["nested"][4][1] == {"x": True}
    assert back["nested"][4][0].dtype == np.int8


@pytest.mark.parametrize("bad, message", [
    (np.array([1 + 2j]), "complex128"),
    (np.array(["text"]), "<U4"),
    (np.array([object()]), "object"),
    (object(), "object"),
    ({1: np.zeros(1)}, "keys must be strings"),
])
def test_only_plain_values_are_sent(bad, message):
    with pytest.raises(TypeError, match=message):
        wire.encode({}, bad)


def read_from_pipe(data: bytes, max_bytes=1 << 20, seconds=2.0):
    read, write = os.pipe()
    try:
        os.write(write, data)
        os.close(write)
        write = None
        return wire.read_message(read, time.monotonic() + seconds, max_bytes)
    finally:
        os.close(read)
        if write is not None:
            os.close(write)


@pytest.mark.parametrize("data, error, message", [
    (b'{"arrays": [{"dtype": "<f8", "shape": [100000, 100000]}]}\n', wire.WireError, "exceed"),
    (b'{"arrays": [{"dtype": "|O", "shape": [1]}]}\n', wire.WireError, "plain number"),
    (b'{"arrays": [{"dtype": "<c16", "shape": [1]}]}\n', wire.WireError, "plain number"),
    (b'{"arrays": [{"dtype": "<f8", "shape": [-1]}]}\n', wire.WireError, "shape"),
    (b'{"arrays": [{"dtype": "<f8", "shape": [1, 1, 1, 1, 1, 1, 1, 1, 1]}]}\n', wire.WireError, "shape"),
    (b'{"arrays": [], "value": {"__array__": 3}}\n', wire.WireError, "out of range"),
    (b'[1, 2]\n', wire.WireError, "JSON object"),
    (b'\xff\xfe\n', wire.WireError, "not JSON"),
    (b'{"arrays": [{"dtype": "<f8", "shape": [4]}]}\n' + b"\0" * 8, EOFError, None),
    (b'{"arrays": []', EOFError, None),
])
def test_the_reader_refuses_what_breaks_the_format_or_its_bounds(data, error, message):
    with pytest.raises(error, match=message):
        read_from_pipe(data)


def test_the_reader_holds_no_more_than_its_bound():
    """A header line that never ends is refused once it passes MAX_HEADER, not read to its end."""
    read, write = os.pipe()
    sent = [0]

    def flood():
        try:
            while sent[0] < 100 * wire.MAX_HEADER:
                sent[0] += os.write(write, b"x" * 65536)
        except OSError:  # the reader closed its end
            pass
    writer = threading.Thread(target=flood)
    writer.start()
    try:
        with pytest.raises(wire.WireError, match="longer than"):
            wire.read_message(read, time.monotonic() + 10, 1 << 20)
    finally:
        os.close(read)
        writer.join()
        os.close(write)
    assert sent[0] < 2 * wire.MAX_HEADER


def test_the_reader_stops_at_its_deadline():
    read, write = os.pipe()
    try:
        os.write(write, b'{"arrays": [{"dtype": "<f8", "shape": [4]}]}\n')  # and no data
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            wire.read_message(read, start + 0.3, 1 << 20)
        assert time.monotonic() - start < 2
    finally:
        os.close(read)
        os.close(write)


# ---- taking the listed functions ---------------------------------------------------------------

GIVEN = '''import numpy as np


def helper(x):
    return x


def wanted(x):
    raise NotImplementedError("wanted")


class Cache:
    def append(self, x):
        raise NotImplementedError("append")

    def given(self):
        return 1
'''


def graded_module(given: str, submitted: str, functions: list[str], tmp_path, probe: str) -> str:
    """Lay ``given`` and the functions taken from ``submitted`` out as the grader does (a library
    with ``refmath/m.py`` and ``refmath/_submitted/``), import ``refmath.m`` in a fresh Python and
    print ``probe``'s value."""
    module, taken, notes = submitted_module(given, submitted, functions, "refmath/m.py")
    files = {"refmath/__init__.py": "", "refmath/m.py": install_lines(given, "refmath/m.py", taken)}
    if taken:
        files[submitted_path("refmath/m.py")] = module
        files["refmath/_submitted/__init__.py"] = INSTALLER
    for path, text in files.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    run = subprocess.run([sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {str(tmp_path)!r})\n"
                          f"import refmath.m as m\nprint(repr({probe}))"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    return run.stdout.strip(), notes


def test_only_the_listed_functions_are_taken(tmp_path):
    submitted = '''import os  # dropped: only the listed functions are taken
print("module-level code: dropped")


def helper(x):
    return "rewritten"


def wanted(x, scale=2):
    """Mine."""
    return helper(x) * scale


class Cache:
    def given(self):
        return "rewritten"

    def append(self, x):
        text = """
a string at column 0
"""
        return text
'''
    shown, notes = graded_module(GIVEN, submitted, ["wanted", "Cache.append"], tmp_path,
                                 "(m.helper(1), m.wanted(3), m.Cache().given(), m.Cache().append(0))")
    assert notes == []
    assert shown == repr((1, 6, 1, "\na string at column 0\n"))  # helper and given() as given


GIVEN_CALLS = GIVEN + '''

TABLE = {"wanted": wanted}  # module-level code that keeps the listed function


def given_total(x):
    return helper(x) + TABLE["wanted"](x)
'''


def test_a_submitted_function_rebinds_only_its_own_namespace(tmp_path):
    submitted = '''
def wanted(x):
    global helper
    helper = lambda x: 1000  # rebinds the submission's own name, not the given module's
    return x
'''
    shown, notes = graded_module(GIVEN_CALLS, submitted, ["wanted"], tmp_path,
                                 "(m.given_total(1), m.given_total(1), m.helper(1))")
    assert notes == [] and shown == "(2, 2, 1)"


def test_the_given_module_cannot_be_rebound_from_outside(tmp_path):
    shown, _ = graded_module(GIVEN_CALLS, "def wanted(x):\n    return x\n", ["wanted"], tmp_path,
                             "type(m).__name__")
    assert shown == "'GivenModule'"
    with pytest.raises(AssertionError, match="cannot be rebound"):
        graded_module(GIVEN_CALLS, "def wanted(x):\n    return x\n", ["wanted"], tmp_path,
                      "setattr(m, 'helper', None)")


@pytest.mark.parametrize("definition, why", [
    ("@staticmethod\ndef wanted(x):\n    return x\n", "has a decorator"),
    ("def wanted(x, y=print('now')):\n    return x\n", "default value"),
    ("def wanted(x, *, y=[].append(1)):\n    return x\n", "default value"),
    ("def wanted(x: print('now')):\n    return x\n", "annotation that calls"),
    ("def wanted(x):\n    globals()['helper'] = None\n", "uses globals()"),
    ("def wanted(x):\n    import refmath.m as m\n    m.helper = None\n", "sets or deletes m.helper"),
    ("def wanted(x):\n    helper.__code__ = None\n", "__code__"),
    ("def wanted(x):\n    import sys\n    return sys\n", "imports sys"),
    ("def wanted(x):\n    return getattr(helper, '__globals__')\n", "getattr"),
    ("def wanted(x):\n    return helper.__getattribute__('__glob' + 'als__')\n", "__getattribute__"),
    ("def wanted(x):\n    import operator\n    return operator.attrgetter('x')\n", "imports operator"),
])
def test_code_that_runs_when_defined_or_reaches_past_its_values_is_refused(definition, why):
    module, taken, notes = submitted_module(GIVEN, definition, ["wanted"], "refmath/m.py")
    assert taken == [] and len(notes) == 1 and why in notes[0] and "refused" in notes[0], notes


def test_literal_and_name_defaults_and_plain_annotations_are_taken():
    definition = "def wanted(x: np.ndarray | None, a=1, b=-2.5, c=(1, 'x'), d=None, e=np) -> int:\n" \
                 "    self_total = x\n    return self_total\n"
    module, taken, notes = submitted_module(GIVEN, definition, ["wanted"], "refmath/m.py")
    assert taken == ["wanted"] and notes == []


def test_a_missing_function_or_a_broken_file_is_graded_as_given():
    module, taken, notes = submitted_module(GIVEN, "def other():\n    pass\n", ["wanted"], "refmath/m.py")
    assert taken == [] and "no function wanted" in notes[0]
    assert install_lines(GIVEN, "refmath/m.py", taken) == GIVEN
    text, notes = take_functions(GIVEN, "def wanted(x:\n", ["wanted"], "refmath/m.py")
    assert text == GIVEN and "does not parse" in notes[0]
    with pytest.raises(ValueError, match="has no function nothing"):
        take_functions(GIVEN, GIVEN, ["nothing"], "refmath/m.py")


# ---- the modes ----------------------------------------------------------------------------------

def bubblewrap():
    if os.environ.get("REFMATH_REQUIRE_SANDBOX") != "1" and (
            sys.platform != "linux" or not sandboxes.shutil.which("bwrap")):
        pytest.skip("bubblewrap is not installed (apt-get install bubblewrap)")
    sandbox = sandboxes.Sandbox("bubblewrap")
    problem = sandbox.probe()
    if problem is not None:
        if os.environ.get("REFMATH_REQUIRE_SANDBOX") == "1":
            pytest.fail(problem)
        pytest.skip(problem)
    return sandbox


def run(sandbox, source, function="probe", inputs=None, limits=LIMITS):
    return sandbox.run(EMPTY_LIBRARY, source, function, inputs or {}, limits)


LOOK_AROUND = '''
def probe(port):
    import os, socket
    def readable(path):
        try:
            with open(path, "rb") as f:
                f.read(1)
            return True
        except OSError:
            return False
    def writable(folder):
        try:
            with open(os.path.join(folder, "w"), "w") as f:
                f.write("x")
            return True
        except OSError:
            return False
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        network = 1
    except OSError:
        network = 0
    seen = sorted(os.listdir("/"))
    return {"network": np.array(network), "uid": np.array(os.getuid()),
            "pids": np.array(sorted(int(p) for p in os.listdir("/proc") if p.isdigit())),
            "tmp": np.array(writable("/tmp")), "work": np.array(writable("/sandbox/work")),
            "usr": np.array(writable("/usr")),
            "passwd": np.array(readable("/etc/passwd")), "root_entries": np.array(len(seen)),
            "torch": np.array(__import__("importlib.util").util.find_spec("torch") is not None)}
'''


def test_bubblewrap_confines_network_processes_and_files():
    sandbox = bubblewrap()
    with socket.create_server(("127.0.0.1", 0)) as server:
        outcome = run(sandbox, LOOK_AROUND, inputs={"port": server.getsockname()[1]})
    assert outcome.status == "ok", outcome.message + outcome.output
    got = {k: v.tolist() for k, v in outcome.value.items()}
    assert got["network"] == 0  # not even the grader's loopback
    assert got["pids"] == [1, 2]  # its own PID namespace: bubblewrap and the driver
    assert got["tmp"] == 1 and got["work"] == 0 and got["usr"] == 0
    assert got["passwd"] == 0  # /etc is not there
    assert got["torch"] == 0
    if os.geteuid() == 0:  # one uid per concurrent test
        assert sandbox.first_uid <= got["uid"] < sandbox.first_uid + sandboxes.SLOTS
    else:
        assert got["uid"] == sandboxes.NOBODY


ESCAPE = '''
def probe():
    import os, time
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            time.sleep(60)
        os._exit(0)
    return {"pid": np.array(os.getpid())}
'''


def sandbox_uid_processes(sandbox):
    """The live processes of ``sandbox``: those of its own block of uids (a root grader), or whose
    command line carries its tag (every fork of its driver); another grader's are not counted."""
    alive = []
    for status in glob.glob("/proc/[0-9]*/status"):
        try:
            with open(status) as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
            uid = int(fields["Uid"].split()[0])
            with open(status[:-len("status")] + "cmdline", "rb") as f:
                cmdline = f.read()
        except (OSError, KeyError, ValueError):
            continue
        if fields["State"].split()[0] == "Z":  # killed, waiting for init to reap it: runs nothing
            continue
        if sandbox.tag.encode() in cmdline or (
                sandbox.first_uid is not None and sandbox.first_uid <= uid < sandbox.first_uid + sandboxes.SLOTS):
            alive.append(status)
    return alive


def test_bubblewrap_kills_a_process_that_left_the_session():
    sandbox = bubblewrap()
    before = sandbox_uid_processes(sandbox)
    assert run(sandbox, ESCAPE).status == "ok"
    time.sleep(0.5)
    assert sandbox_uid_processes(sandbox) == before


SLEEPER = '''
def probe():
    import time
    time.sleep(3)
    return {"slept": np.array(1)}
'''


def test_another_graders_tests_are_neither_counted_nor_sharing_uids():
    mine, theirs = bubblewrap(), bubblewrap()  # two graders on one machine
    if os.geteuid() == 0:
        assert abs(mine.first_uid - theirs.first_uid) >= sandboxes.SLOTS  # blocks of their own
    done = []
    other = threading.Thread(target=lambda: done.append(run(theirs, SLEEPER)))
    other.start()
    try:
        deadline = time.monotonic() + 10
        while not sandbox_uid_processes(theirs) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sandbox_uid_processes(theirs), "the other grader's test was never seen running"
        assert sandbox_uid_processes(mine) == []
    finally:
        other.join()
    assert done[0].status == "ok"


# Forks children that sleep until it cannot fork any more; counts them in `children`.
FORK_BOMB = """
import os, time
children = 0
try:
    while True:
        if os.fork() == 0:
            time.sleep(30)
            os._exit(0)
        children += 1
except OSError:
    pass
"""


def test_the_process_limit_stops_a_fork_bomb():
    sandbox = bubblewrap()
    body = "".join(f"    {line}\n" for line in FORK_BOMB.strip().splitlines())
    bomb = f"def probe():\n{body}    return {{'children': np.array(children)}}\n"
    start = time.monotonic()
    outcome = run(sandbox, bomb)
    assert outcome.status == "ok", outcome.message
    assert 0 < int(outcome.value["children"]) < sandboxes.PROCESSES
    assert time.monotonic() - start < 10


def user_mode_python():
    """A Python of this version that a sandbox uid can run, or skip."""
    if sys.platform != "linux" or os.geteuid() != 0:
        pytest.skip("the user mode needs a root grader on Linux")
    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    for candidate in (sandboxes.interpreter(), f"/usr/bin/python{version}",
                      f"/usr/local/bin/python{version}"):
        if not os.path.exists(candidate):
            continue
        try:
            check = subprocess.run([candidate, "-I", "-S", "-c", "import sys; print(sys.version_info[:2])"],
                                   user=sandboxes.FIRST_UID + 63, group=sandboxes.FIRST_UID + 63,
                                   extra_groups=[], capture_output=True, text=True)
        except OSError:  # not executable by that uid (a Python under /root, say)
            continue
        if check.returncode == 0 and check.stdout.strip() == str(tuple(sys.version_info[:2])):
            return candidate
    pytest.skip(f"no Python {version} that an unprivileged uid may run")


def test_user_mode_runs_as_its_own_uid_and_kills_what_it_left(monkeypatch, tmp_path):
    monkeypatch.setenv("REFMATH_SANDBOX_PYTHON", user_mode_python())
    secret = tmp_path / "hidden_tests.py"
    secret.write_text("# the grader's\n")
    os.chmod(tmp_path, 0o700)  # as run_autograder makes /autograder
    sandbox = sandboxes.Sandbox("user", unreadable=(str(secret),), search_roots=(str(tmp_path),))
    assert sandbox.probe() is None
    before = sandbox_uid_processes(sandbox)
    outcome = run(sandbox, ESCAPE)
    assert outcome.status == "ok", outcome.message + outcome.output
    time.sleep(0.5)
    assert sandbox_uid_processes(sandbox) == before


LITTER = '''
def probe():
    import os
    for folder in ("/tmp", "/dev/shm"):
        os.makedirs(os.path.join(folder, "refmath-litter-dir"), exist_ok=True)
        with open(os.path.join(folder, "refmath-litter-dir", "f"), "w") as f:
            f.write("x")
        with open(os.path.join(folder, "refmath-litter"), "w") as f:
            f.write("x")
    return {"uid": np.array(os.getuid())}
'''


def test_user_mode_removes_what_a_test_left_in_shared_folders(monkeypatch, tmp_path):
    monkeypatch.setenv("REFMATH_SANDBOX_PYTHON", user_mode_python())
    sandbox = sandboxes.Sandbox("user", search_roots=(str(tmp_path),))
    outcome = run(sandbox, LITTER)
    assert outcome.status == "ok", outcome.message + outcome.output
    left = [p for p in glob.glob("/tmp/refmath-litter*") + glob.glob("/dev/shm/refmath-litter*")
            if os.lstat(p).st_uid == int(outcome.value["uid"])]
    assert left == []


def test_user_mode_refuses_where_a_copy_of_the_reference_is_readable(monkeypatch):
    monkeypatch.setenv("REFMATH_SANDBOX_PYTHON", user_mode_python())
    folder = tempfile.mkdtemp(dir="/tmp")  # a checkout elsewhere on the machine, world-readable
    try:
        os.chmod(folder, 0o755)
        os.makedirs(os.path.join(folder, "copy", "refmath"))
        for sub in ("copy", "copy/refmath"):
            os.chmod(os.path.join(folder, sub), 0o755)
        with open(os.path.join(folder, "copy", "refmath", "attention.py"), "w") as f:
            f.write("def sdpa_forward():\n    # BEGIN SOLUTION\n    pass\n")
        os.chmod(os.path.join(folder, "copy", "refmath", "attention.py"), 0o644)
        problem = sandboxes.Sandbox("user", search_roots=(folder,)).probe()
        assert problem is not None and "copy/refmath/attention.py" in problem, problem
        os.chmod(os.path.join(folder, "copy"), 0o700)  # as the instructor is told to
        assert sandboxes.Sandbox("user", search_roots=(folder,)).probe() is None
    finally:
        shutil.rmtree(folder)


def test_user_mode_refuses_to_run_where_it_can_read_the_grader(monkeypatch):
    monkeypatch.setenv("REFMATH_SANDBOX_PYTHON", user_mode_python())
    folder = tempfile.mkdtemp(dir="/tmp")  # pytest's own folders are root-only
    try:
        os.chmod(folder, 0o755)
        secret = os.path.join(folder, "hidden_tests.py")
        with open(secret, "w") as f:
            f.write("# readable by everyone\n")
        os.chmod(secret, 0o644)
        problem = sandboxes.Sandbox("user", unreadable=(secret,), search_roots=(folder,)).probe()
    finally:
        shutil.rmtree(folder)
    assert problem is not None and f"the sandbox user can read {secret}" in problem


def test_no_sandbox_is_refused_with_the_reason(monkeypatch):
    monkeypatch.setattr(sandboxes.shutil, "which", lambda name: None)
    monkeypatch.setattr(sandboxes.os, "geteuid", lambda: 1000)
    with pytest.raises(RuntimeError, match="bubblewrap is not installed.*--no-sandbox"):
        sandboxes.choose()
    with pytest.raises(ValueError, match="'user' needs a root grader"):
        sandboxes.Sandbox("user")  # it would run the tests as the grader's own user


def test_a_python_the_sandbox_uid_cannot_run_is_a_reason_not_a_crash(monkeypatch):
    # the root-only interpreter of a machine whose Python lives under /root: the user mode is
    # refused with the reason, and the way out is named
    if os.geteuid() != 0:
        pytest.skip("the user mode needs a root grader")
    monkeypatch.setattr(sandboxes.shutil, "which", lambda name: None)
    monkeypatch.setenv("REFMATH_SANDBOX_PYTHON", "/nonexistent/python3")
    with pytest.raises(RuntimeError, match="user: .*nonexistent.*REFMATH_SANDBOX_PYTHON"):
        sandboxes.choose()
