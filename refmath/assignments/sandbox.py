"""Run one hidden test's student side in a sandbox, and read back only its arrays.

Three ways to run it, chosen by :func:`choose` and recorded in the results:

``bubblewrap`` (Linux, ``bwrap`` installed; what the grader uses whenever it can)
    New PID, network, IPC and UTS namespaces: no network at all (not even loopback), and every
    process the test starts dies with it, ``setsid`` or not. The file system is a fresh tmpfs
    holding read-only binds of the system's programs and libraries, the Python interpreter's
    standard library (its site-packages hidden), NumPy, and the test's folder (the submission laid
    over the stubbed library, the inputs, the driver); ``/tmp`` is a private tmpfs of bounded size,
    the only place it can write. The grader's files, the hidden tests, the reference solutions,
    torch and the other submissions are not in that file system. Started by root, bubblewrap
    mounts as root and the driver then drops to a uid of its own (one per concurrent test), so the
    process limit counts only that test; started by anyone else, an unprivileged user namespace
    maps it to ``nobody``.
``user`` (root, where namespaces are refused: a Docker container's default seccomp profile)
    The driver runs as a uid of its own in a private folder, with the same limits; after the test
    every process of that uid is killed. It can read what any user can read, so the driver first
    checks that it cannot read the hidden tests, the grader's package or the folder holding torch,
    and refuses to run otherwise (the Gradescope bundle's ``setup.sh`` makes them root-only).
    There is no network isolation in this mode.
``none`` (``--no-sandbox``, for code the instructor trusts)
    A separate process with the limits, and nothing else.

In every mode the student's process receives only the source of the test's ``run`` and its inputs
(:mod:`~refmath.assignments.wire`), and its output is read through a bounded reader; the check runs
in the grader.
"""
from __future__ import annotations

import fcntl
import glob
import importlib.util
import os
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from typing import NamedTuple

import numpy as np

from refmath.assignments import checks, usage, wire
from refmath.assignments.manifest import Limits
from refmath.assignments.text import clean

__all__ = ["Outcome", "interpreter", "bubblewrap_command", "environment", "remove_files_of",
           "claim_uids", "Sandbox", "choose"]

MODES = ("bubblewrap", "user", "none")
HERE = os.path.dirname(os.path.abspath(__file__))
# The packages a submission may import besides the standard library and its own refmath.
STUDENT_PACKAGES = ("numpy", "numpy.libs", "tqdm")
# The uids the tests run as when the grader is root: one per concurrent test, far above the ranges
# that systems hand to users and to subordinate-uid maps.
FIRST_UID = 2_000_000_000
PROCESSES = 32  # per test: the driver needs one, bubblewrap two
RESULT_MB = 256  # the most that is read back from one test
TMP_MB = 64  # the sandbox's private /tmp
NOBODY = 65534
SLOTS = 64  # tests at once, each with a uid of its own
# Graders running at once on one machine each hold a block of SLOTS uids of their own (a lock file
# per block), so that one grader's limits and clean-up never count or kill another's tests.
UID_BLOCKS = 1024


class Outcome(NamedTuple):
    status: str  # "ok", "error" (an exception), "killed" (limits, crash, exit), "timeout", "setup"
    message: str  # one line for the student; empty when status is "ok"
    output: str  # the head of what the process printed
    seconds: float
    value: dict | None = None  # the arrays run() returned, when status is "ok"


def interpreter() -> str:
    """The Python the sandbox runs: ``REFMATH_SANDBOX_PYTHON``, else this one's base interpreter
    (outside any virtual environment, whose site-packages hold the grader's packages). It must be
    the same Python version, for NumPy's compiled modules."""
    chosen = os.environ.get("REFMATH_SANDBOX_PYTHON")
    return chosen or os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


def student_site() -> dict[str, str]:
    """``{name: folder}`` of :data:`STUDENT_PACKAGES` as this Python finds them."""
    found = {}
    for name in STUDENT_PACKAGES:
        if name.endswith(".libs"):  # the shared libraries a manylinux wheel puts beside it
            parent = found.get(name[:-len(".libs")])
            folder = parent and os.path.join(os.path.dirname(parent), name)
        else:
            spec = importlib.util.find_spec(name)
            folder = spec and spec.submodule_search_locations and spec.submodule_search_locations[0]
        if folder and os.path.isdir(folder):
            found[name] = os.path.realpath(folder)
    if "numpy" not in found:
        raise RuntimeError("the grader cannot find NumPy to give the sandbox")
    return found


def _site_directories() -> list[str]:
    """Every folder where the base interpreter would find installed packages."""
    base = {"base": sys.base_prefix, "platbase": sys.base_exec_prefix}
    paths = {sysconfig.get_paths(vars=base)[k] for k in ("purelib", "platlib")}
    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    paths |= set(glob.glob("/usr/lib/python3/dist-packages")) | set(
        glob.glob(f"/usr/local/lib/python{version}/*-packages")) | set(
        glob.glob(f"/usr/lib/python{version}/*-packages"))
    return sorted(p for p in paths if os.path.isdir(p))


def _ancestors(path: str) -> list[str]:
    """``/a``, ``/a/b``, ``/a/b/c`` for ``/a/b/c``."""
    parts = path.strip("/").split("/")
    return ["/" + "/".join(parts[:i]) for i in range(1, len(parts) + 1) if parts[0]]


def bubblewrap_command(folder: str, site: dict[str, str], tmp_mb: int = TMP_MB) -> list[str]:
    """The ``bwrap`` command line up to ``--`` for a test whose files are in ``folder``: inside,
    ``folder`` is ``/sandbox/work`` and the packages are in ``/sandbox/site``."""
    command = ["bwrap", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
               "--unshare-cgroup-try", "--die-with-parent", "--new-session",
               "--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            command += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            command += ["--ro-bind", top, top]
    command += ["--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    prefixes = {os.path.realpath(sys.base_prefix), os.path.realpath(sys.base_exec_prefix),
                os.path.dirname(os.path.dirname(interpreter()))}
    prefixes = sorted(p for p in prefixes if not (p + "/").startswith("/usr/"))
    # bubblewrap makes the folders above a bind mode 0700: the dropped user must pass through them.
    above = {os.path.dirname(p) for p in prefixes} | {"/sandbox/site"}
    for folder_above in sorted({a for p in above for a in _ancestors(p)}):
        command += ["--perms", "0755", "--dir", folder_above]
    for prefix in prefixes:
        command += ["--ro-bind", prefix, prefix]
    for site_dir in _site_directories():  # hidden: torch and the grader's refmath may be there
        command += ["--tmpfs", site_dir]
    for name, source in site.items():
        command += ["--ro-bind", source, f"/sandbox/site/{name}"]
    command += ["--ro-bind", folder, "/sandbox/work",
                "--perms", "1777", "--size", str(tmp_mb * 2**20), "--tmpfs", "/tmp",
                "--proc", "/proc", "--dev", "/dev", "--chdir", "/tmp"]
    if os.geteuid() != 0:
        command += ["--unshare-user", "--uid", str(NOBODY), "--gid", str(NOBODY)]
    return command


def environment(home: str) -> dict[str, str]:
    """A minimal environment: one thread for BLAS and OpenMP, nothing inherited."""
    env = {"PATH": "/usr/bin:/bin", "HOME": home, "TMPDIR": home, "LANG": "C.UTF-8",
           "PYTHONHASHSEED": "0", "MPLBACKEND": "Agg"}
    for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
                 "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS"):
        env[name] = "1"
    return env


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _kill_user(uid: int) -> None:
    """Kill every process of ``uid``: one more process of that uid calls kill(-1), which signals
    every process the caller may signal but itself, that is every other process of the uid."""
    subprocess.run([interpreter(), "-I", "-S", "-c",
                    "import os, signal\ntry:\n    os.kill(-1, signal.SIGKILL)\nexcept OSError:\n"
                    "    pass\n"], user=uid, group=uid, extra_groups=[], timeout=30,
                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


SHARED_WRITABLE = ("/tmp", "/var/tmp", "/dev/shm")  # where any uid may leave files


def remove_files_of(uid: int, folders=SHARED_WRITABLE) -> None:
    """Remove what ``uid`` left in the folders every user may write to (``user`` mode: its
    processes are dead by now), never following a link."""
    for folder in folders:
        for top, dirs, files in os.walk(folder, topdown=True):
            for name in [*dirs, *files]:
                path = os.path.join(top, name)
                try:
                    info = os.lstat(path)
                except OSError:
                    continue
                if info.st_uid != uid:
                    continue
                if name in dirs:
                    dirs.remove(name)
                if stat.S_ISDIR(info.st_mode):
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    try:
                        os.unlink(path)
                    except OSError:
                        pass


PROBE = '''
def probe(port):
    import os, socket
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError as error:
        network = type(error).__name__
    else:
        network = "open"
    return {"pid": np.array(os.getpid()), "uid": np.array(os.getuid()),
            "net": np.frombuffer(network.encode(), dtype=np.uint8)}
'''


def claim_uids() -> tuple[int, int]:
    """``(first uid, lock descriptor)``: a block of :data:`SLOTS` uids no other grader on this
    machine holds, for as long as the descriptor stays open (this process's life)."""
    folder = "/run/refmath-sandbox" if os.path.isdir("/run") else os.path.join(
        tempfile.gettempdir(), "refmath-sandbox")
    os.makedirs(folder, mode=0o700, exist_ok=True)
    for block in range(UID_BLOCKS):
        fd = os.open(os.path.join(folder, f"uids-{block}.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC,
                     0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        return FIRST_UID + block * SLOTS, fd
    raise RuntimeError(f"all {UID_BLOCKS} blocks of sandbox uids are held by other graders")


# Walks the given roots as the test's uid for what a submission would look for: a refmath whose
# sources hold solution regions, or hidden tests; returns the first it can read.
SEARCH = '''
def search(roots, seconds):
    import os, time
    start = time.monotonic()
    skip = {"/proc", "/sys", "/dev", "/run"}
    for root in roots:
        for top, dirs, files in os.walk(root):
            dirs[:] = [d for d in dirs if os.path.join(top, d) not in skip]
            if time.monotonic() - start > seconds:
                return {"found": np.zeros(0, np.uint8), "finished": np.array(0)}
            for name in files:
                path = os.path.join(top, name)
                if not (path.endswith("refmath/attention.py") or path.endswith("hidden/tests.py")):
                    continue
                try:
                    with open(path, "rb") as f:
                        text = f.read()
                except OSError:
                    continue
                if b"# BEGIN SOLUTION" in text or b"@hidden_test" in text:
                    return {"found": np.frombuffer(path.encode(), np.uint8), "finished": np.array(1)}
    return {"found": np.zeros(0, np.uint8), "finished": np.array(1)}
'''
SEARCH_S = 20  # seconds the user mode's search may take


class Sandbox:
    """Runs student-side code in one of :data:`MODES`.

    ``unreadable``: in ``user`` mode, paths the driver must fail to read before it runs anything;
    ``search_roots``: where the ``user`` mode's probe looks for readable reference copies.
    """

    def __init__(self, mode: str, unreadable: tuple[str, ...] = (), search_roots=("/",)):
        if mode not in MODES:
            raise ValueError(f"sandbox mode must be one of {MODES}, got {mode!r}")
        if mode == "user" and os.geteuid() != 0:  # it runs each test as a uid of its own
            raise ValueError("sandbox mode 'user' needs a root grader")
        self.mode = mode
        self.first_uid, self._uid_lock = claim_uids() if os.geteuid() == 0 and mode != "none" \
            else (None, None)
        self._copies = None  # the world-readable copies of the student packages (user mode)
        self.unreadable = tuple(unreadable)
        self.search_roots = tuple(search_roots)
        self.site = student_site()
        if mode == "user":
            self.site = self._readable_site()
        self._slots = list(range(SLOTS))
        self._lock = threading.Lock()
        # on every driver's command line (and so of every process it forks): what is this
        # sandbox's, for a test to count, on a machine where others grade too
        self.tag = f"refmath-sandbox-{secrets.token_hex(6)}"
        self._idle_cpu = None

    def probe(self) -> str | None:
        """``None`` when a trivial test runs in this sandbox, else why not (one line)."""
        limits = Limits(wall_s=30, cpu_s=10, memory_mb=1024, output_kb=64)
        # A port the grader listens on: the sandbox must not reach it.
        with socket.create_server(("127.0.0.1", 0)) as server:
            try:
                outcome = self.run({"refmath/__init__.py": ""}, PROBE, "probe",
                                   {"port": server.getsockname()[1]}, limits)
            except (OSError, subprocess.SubprocessError) as error:
                return f"{type(error).__name__}: {error}"
        if outcome.status != "ok":
            printed = " ".join(outcome.output.split())[:200]
            return outcome.message + (f" ({printed})" if printed else "")
        if self.mode == "bubblewrap" and bytes(outcome.value["net"]).decode() == "open":
            return "the network was reachable inside the sandbox"
        if self.mode == "user":
            return self._search_for_references()
        return None

    def _search_for_references(self) -> str | None:
        """In ``user`` mode, the test's uid reads what any user may read: walk the file system as
        that uid, as a submission would, and refuse if it finds a copy of the reference solutions
        (a checkout, an installed refmath) or of hidden tests, or cannot finish looking."""
        limits = Limits(wall_s=SEARCH_S + 15, cpu_s=SEARCH_S + 5, memory_mb=1024, output_kb=64)
        outcome = self.run({"refmath/__init__.py": ""}, SEARCH, "search",
                           {"roots": list(self.search_roots), "seconds": float(SEARCH_S)}, limits)
        if outcome.status != "ok":
            return f"the search for readable reference copies failed: {outcome.message}"
        found = bytes(outcome.value["found"]).decode("utf-8", "replace")
        if found:
            return (f"the sandbox user can read {found}, a copy of the reference solutions or "
                    "hidden tests: make it unreadable to other users (chmod o-rx on a folder "
                    "above it)")
        if not int(outcome.value["finished"]):
            return (f"the search for readable reference copies did not finish in {SEARCH_S} s: "
                    "the user mode cannot show that none is readable")
        return None

    def idle_cpu_s(self) -> float:
        """CPU seconds of a test that does nothing (the interpreter, NumPy, the driver), measured
        once: what a cost check takes off a test's CPU time before comparing it."""
        if self._idle_cpu is None:
            limits = Limits(wall_s=30, cpu_s=10, memory_mb=1024, output_kb=64)
            run = self.run({"refmath/__init__.py": ""}, "def idle():\n    return {}\n", "idle", {},
                           limits)
            self._idle_cpu = float(run.value[checks.CPU_S]) if run.status == "ok" else 0.0
        return self._idle_cpu

    def _readable_site(self) -> dict[str, str]:
        """The student packages where the sandbox uids can read them: a package the grader finds
        in a folder closed to other users (a root-only virtual environment, say) is copied once
        into a world-readable folder that lives as long as this sandbox."""
        probe_uid = self.first_uid + SLOTS - 1
        readable = {}
        for name, folder in self.site.items():
            check = subprocess.run(
                [interpreter(), "-I", "-S", "-c",
                 "import os, sys\nsys.exit(0 if os.access(sys.argv[1], os.R_OK | os.X_OK) else 1)",
                 folder], user=probe_uid, group=probe_uid, extra_groups=[], timeout=30,
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            if check.returncode == 0:
                readable[name] = folder
                continue
            if self._copies is None:
                self._copies = tempfile.TemporaryDirectory(prefix="refmath-sandbox-site-")
                os.chmod(self._copies.name, 0o755)
            readable[name] = os.path.join(self._copies.name, name)
            shutil.copytree(folder, readable[name], symlinks=True)
            for root, dirs, files in os.walk(readable[name]):
                os.chmod(root, 0o755)
                for file in files:
                    path = os.path.join(root, file)
                    if not os.path.islink(path):
                        os.chmod(path, 0o755 if os.access(path, os.X_OK) else 0o644)
        return readable

    def _slot(self) -> int:
        with self._lock:
            return self._slots.pop(0)

    def _free(self, slot: int) -> None:
        with self._lock:
            self._slots.append(slot)

    def run(self, library: dict[str, str | bytes], source: str, function: str, inputs: dict,
            limits: Limits) -> Outcome:
        """Run ``function`` (defined by ``source``) on ``inputs`` with ``library`` ({path: text or
        bytes}, the refmath to import and any given files beside it) under ``limits``."""
        slot = self._slot()
        uid = None if self.first_uid is None else self.first_uid + slot
        folder = tempfile.mkdtemp(prefix="refmath-grade-")
        try:
            return self._run(folder, uid, library, source, function, inputs, limits)
        finally:
            if self.mode == "user":
                _kill_user(uid)
                remove_files_of(uid)
            shutil.rmtree(folder, ignore_errors=True)
            self._free(slot)

    def _write(self, folder: str, library: dict[str, str | bytes], message: bytes) -> None:
        for path, content in library.items():  # text, or bytes (a compiled given part)
            target = os.path.join(folder, "library", path)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with open(target, "wb") as f:
                f.write(content if isinstance(content, bytes) else content.encode("utf-8"))
        os.makedirs(os.path.join(folder, "grader"))
        for name in ("driver.py", "wire.py"):
            shutil.copyfile(os.path.join(HERE, name), os.path.join(folder, "grader", name))
        with open(os.path.join(folder, "inputs.bin"), "wb") as f:
            f.write(message)
        if self.mode == "user":
            os.makedirs(os.path.join(folder, "site"))
            for name, source in self.site.items():
                os.symlink(source, os.path.join(folder, "site", name))
            os.makedirs(os.path.join(folder, "tmp"))
        for root, dirs, files in os.walk(folder):  # readable by the sandbox user, writable by none
            os.chmod(root, 0o755)
            for name in files:
                os.chmod(os.path.join(root, name), 0o644)

    def _command(self, folder: str, uid: int | None, limits: Limits) -> tuple[list[str], dict]:
        inside = "/sandbox/work" if self.mode == "bubblewrap" else folder
        site = "/sandbox/site" if self.mode == "bubblewrap" else os.path.join(folder, "site")
        if self.mode == "none":
            site = os.path.dirname(self.site["numpy"])
        driver = [interpreter(), "-I", "-S", "-B", f"{inside}/grader/driver.py",
                  "--inputs", f"{inside}/inputs.bin", "--library", f"{inside}/library",
                  "--site", site, "--cpu", str(max(1, int(limits.cpu_s))),
                  "--memory", str(limits.memory_mb * 2**20),
                  # what it prints goes to a file of the grader's, capped after the run; files in
                  # the sandbox's /tmp (a compiled module, say) are bounded by its size as well
                  "--file-size", str(TMP_MB * 2**20),
                  "--processes", str(PROCESSES), "--tag", self.tag]
        options: dict = {"env": environment("/tmp" if self.mode == "bubblewrap" else
                                            os.path.join(folder, "tmp") if self.mode == "user"
                                            else folder)}
        if self.mode == "bubblewrap":
            if uid is not None:
                driver += ["--uid", str(uid)]
            return bubblewrap_command(folder, self.site) + ["--", *driver], options
        if self.mode == "user":
            os.chown(os.path.join(folder, "tmp"), uid, uid)
            driver += ["--unreadable", *self.unreadable]
            options.update(user=uid, group=uid, extra_groups=[], cwd=os.path.join(folder, "tmp"))
        else:
            options.update(cwd=folder, start_new_session=True)
        return driver, options

    def _run(self, folder, uid, library, source, function, inputs, limits) -> Outcome:
        self._write(folder, library, wire.encode({"source": source, "function": function}, inputs))
        command, options = self._command(folder, uid, limits)
        output_path = os.path.join(folder, "output.txt")
        start = time.monotonic()
        deadline = start + limits.wall_s
        head, value, problem = None, None, None
        with open(output_path, "wb") as output:
            process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                       stderr=output, **options)
            # the memory of all the test's processes together, read by the grader from /proc
            watch = usage.Watch(process.pid, uid, limits.memory_mb * 2**20,
                                lambda: self._kill(process, uid))
            watch.start()
            try:
                head, value = wire.read_message(process.stdout.fileno(), deadline,
                                                RESULT_MB * 2**20)
            except TimeoutError:
                problem = "timeout"
            except EOFError:
                problem = "eof"
            except wire.WireError as error:
                problem = f"the test's output could not be read: {error}"
            returncode, rusage = usage.wait(process.pid, deadline + 1)
            if returncode is None:
                problem = problem or "timeout"
                self._kill(process, uid)
                returncode, rusage = usage.wait(process.pid, None)
            process.returncode = returncode  # reaped here, by wait4, for its resource usage
            watch.finish()
            self._stop(process)
            process.stdout.close()
        seconds = time.monotonic() - start
        if watch.over and problem != "timeout":
            problem = (f"used more than {limits.memory_mb} MB of memory, all its processes "
                       "together (the limit is per test)")
            head = None
        peak = watch.peak
        if head is not None and head.get("status") == "ok" and isinstance(value, dict):
            # measured by the kernel, outside the student's process: whatever it sent under these
            # names is replaced
            value[checks.PEAK_RSS] = np.array(peak)
            value[checks.CPU_S] = np.array(max(rusage.ru_utime + rusage.ru_stime, watch.cpu_s))
        return self._outcome(output_path, limits, head, value, problem, returncode, seconds)

    def _kill(self, process: subprocess.Popen, uid: int | None) -> None:
        """End the test now: its first process (bubblewrap's PID namespace dies with it), its
        session (``none``), every process of its uid (``user``)."""
        try:
            os.kill(process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if self.mode == "none":
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if self.mode == "user" and uid is not None:
            _kill_user(uid)

    def _stop(self, process: subprocess.Popen) -> None:
        """End the test's processes: bubblewrap's PID namespace dies with its first process; in
        ``user`` mode the uid's processes are killed after the run; ``none`` kills its session."""
        if process.poll() is None:
            process.kill()
        if self.mode == "none":
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        process.wait()

    @staticmethod
    def _outcome(output_path, limits, head, value, problem, returncode, seconds) -> Outcome:
        cap = limits.output_kb * 1024
        printed = os.path.getsize(output_path)
        with open(output_path, "rb") as f:
            text = f.read(min(cap, 2000)).decode("utf-8", "replace")
        if problem == "timeout":
            return Outcome("timeout", f"timed out: still running after {limits.wall_s:g} s "
                           "(wall-clock limit); an infinite loop or a very slow method?", text, seconds)
        if printed > cap:
            return Outcome("killed", f"printed {printed / 1024:.0f} KB or more; the limit is "
                           f"{limits.output_kb} KB of output", text[:500], seconds)
        if problem is not None and problem != "eof":
            return Outcome("killed", clean(problem, 300), text, seconds)
        if problem == "eof":
            # a signal: the driver's own (negative status), or passed on by bubblewrap as 128 + n
            number = (-returncode if returncode is not None and returncode < 0 else
                      returncode - 128 if returncode is not None and returncode > 128 else None)
            if number is not None:
                name = _signal_name(number)
                why = {"SIGXCPU": f"used more than {limits.cpu_s:g} s of CPU time (the limit)",
                       "SIGKILL": f"was killed (CPU time above {limits.cpu_s:g} s or out of memory)",
                       "SIGSEGV": "crashed with a segmentation fault",
                       "SIGABRT": "aborted (SIGABRT)", "SIGBUS": "crashed (bus error)",
                       "SIGFPE": "crashed (floating-point exception)"}.get(name,
                                                                         f"was killed by {name}")
                return Outcome("killed", why, text, seconds)
            return Outcome("killed", f"the process ended (exit status {returncode}) before the "
                           "test finished: os._exit(), a crash, or an exit from native code",
                           text, seconds)
        status = head.get("status")
        if status == "ok" and isinstance(value, dict):
            return Outcome("ok", "", text, seconds, value)
        if status == "ok":
            return Outcome("killed", "the test's output is not a dict of arrays", text, seconds)
        # the student's process wrote these: any text, of any length
        error, message = clean(head.get("error", "?"), 100), clean(head.get("message", ""), 300)
        where = clean(head.get("where", ""), 200)
        if error == "MemoryError":
            message = f"ran out of memory (limit {limits.memory_mb} MB of address space)"
        described = (f"raised {error}" + (f": {message}" if message else "")
                     + (f" ({where})" if where else ""))
        if error == "SystemExit":
            described = message + (f" ({where})" if where else "")
        return Outcome("setup" if status == "setup" else "error", described, text, seconds)


def choose(unreadable: tuple[str, ...] = ()) -> Sandbox:
    """The strongest sandbox this machine can make, proven by running a probe in it:
    ``bubblewrap`` if it runs, else ``user`` when the grader is root; else ``RuntimeError`` with
    the reason (the command line's ``--no-sandbox`` then grades without one, and says so)."""
    reasons = []
    for mode in ("bubblewrap", "user"):
        if mode == "bubblewrap" and shutil.which("bwrap") is None:
            reasons.append("bubblewrap is not installed (Debian/Ubuntu: apt-get install bubblewrap)")
            continue
        if mode == "user" and os.geteuid() != 0:
            reasons.append("user: the grader is not root, so it cannot run tests as a uid of their "
                           "own")
            continue
        try:
            sandbox = Sandbox(mode, unreadable)
        except OSError as error:  # e.g. a sandbox uid may not run this Python (one under /root)
            reasons.append(f"{mode}: {error} (REFMATH_SANDBOX_PYTHON names an interpreter of the "
                           f"same version that every user can run)")
            continue
        problem = sandbox.probe()
        if problem is None:
            return sandbox
        reasons.append(f"{mode}: {problem}")
    raise RuntimeError("no sandbox can be made here, so untrusted code is refused ("
                       + "; ".join(reasons) + "); --no-sandbox grades without one, for code you "
                       "trust")
