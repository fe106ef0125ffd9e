"""Submissions that attack the grader, graded through the real ``grade`` and ``--batch`` paths.

Each attack is the reference ``attention.py`` with code planted at the top of ``sdpa_forward``. An
attack that wants marks falls through to the reference code only if it got what it wanted (the
answer, the check code, a solution file, the network) and raises otherwise: it scores the points of
the tests that call ``sdpa_forward`` exactly when the attack worked. An attack that wants to harm
always raises, and what it harmed is looked for on the grader's side: files outside the sandbox,
the hidden tests, other submissions' files and scores, results written afterwards, processes left
running. Graded on two tests: ``sdpa_forward_plain`` (2 points, calls the attacked function) and
``gqa_head_map_values`` (2 points, does not), so every attack deserves exactly 2.
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
import resource
import socket
import subprocess
import sys
import sysconfig
import threading
import time

import pytest

from refmath.assignments import manifest as manifests
from refmath.assignments import sandbox as sandboxes
from refmath.assignments.build import build
from refmath.assignments.grade import grade, load_hidden_tests, secret_paths, with_time_limit
from test_assignments_sandbox import FORK_BOMB, sandbox_uid_processes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ONLY = "sdpa_forward_plain,gqa_head_map_values"
DESERVED = 2.0  # gqa_head_map_values only
ATTENDED = 4.0  # what an attack that worked would score

pytest.importorskip(
    "torch", reason="the hidden tests compute expected values with PyTorch: install the 'assignments' extra")


def manifest():
    return manifests.load("attention", os.path.join(ROOT, "assignments"))


@pytest.fixture(scope="module")
def sandbox():
    """The sandbox the grader chooses here; CI (REFMATH_REQUIRE_SANDBOX=1) fails without one."""
    try:
        return sandboxes.choose(unreadable=secret_paths(manifest(), ROOT))
    except RuntimeError as error:
        if os.environ.get("REFMATH_REQUIRE_SANDBOX") == "1":
            raise
        pytest.skip(str(error))


def reference_text() -> str:
    with open(os.path.join(ROOT, "refmath", "attention.py")) as f:
        return f.read()


def planted(code: str) -> str:
    """The reference attention.py with ``code`` run first in sdpa_forward's solution region."""
    lines = reference_text().splitlines()
    begin = next(i for i, line in enumerate(lines) if line.strip() == "# BEGIN SOLUTION")
    indent = lines[begin][:len(lines[begin]) - len(lines[begin].lstrip())]
    lines[begin + 1:begin + 1] = [indent + line if line else line for line in code.splitlines()]
    return "\n".join(lines) + "\n"


def write_submission(folder, text: str) -> str:
    os.makedirs(os.path.join(folder, "refmath"), exist_ok=True)
    with open(os.path.join(folder, "refmath", "attention.py"), "w") as f:
        f.write(text)
    return str(folder)


# Every file of these names the sandbox lets it see (outside /proc, /sys, /dev and /usr), within
# two seconds.
WALK = """
def visible(names):
    import os, time
    start, found = time.monotonic(), []
    for top, dirs, files in os.walk("/"):
        dirs[:] = [d for d in dirs if os.path.join(top, d) not in ("/proc", "/sys", "/dev", "/usr")]
        # (the name spelt in two: a whole dunder string in a submitted function is refused)
        found += [os.path.join(top, n) for n in files if n in names or n.startswith("__" + "editable")]
        if time.monotonic() - start > 2:
            break
    return found
"""


def gain(search: str) -> str:
    """An attack that falls through to the answer only if ``search`` (code setting ``found``)
    found something."""
    return f"found = []\n{search}\nif not found:\n    raise RuntimeError('the attack held')\n"


def harm(action: str) -> str:
    return f"{action}\nraise RuntimeError('the attack is done')\n"


GRADER_CWDS = sorted({os.getcwd(), ROOT})  # the in-process grader's and the command's
MARK = "refmath_hostile_was_here"
SITE_DIRS = sorted({sysconfig.get_paths()["purelib"], *sandboxes._site_directories()})


def attacks(batch: str, port: int) -> dict[str, str]:
    """``{name: planted code}``; ``batch`` is the batch folder, ``port`` a local server's."""
    hidden = os.path.join(ROOT, "assignments", "attention", "hidden", "tests.py")
    # what a process left running would rewrite: a later submission, the scores and the results
    victims = [f"{batch}/zz_reference/refmath/attention.py", f"{batch}/../scores.csv",
               f"{batch}/../scores-results/zz_reference.json"]
    return {
        # The grader imports a module from its working directory after student code ran.
        "module planted for the grader": harm(f"""
import os
for where in [*{GRADER_CWDS!r}, *(f"/proc/{{p}}/cwd" for p in os.listdir("/proc") if p.isdigit())]:
    try:
        with open(os.path.join(where, "{MARK}.py"), "w") as f:
            f.write("print('planted')")
    except OSError:
        pass"""),
        # A .pth file runs in every later Python that reads that site-packages.
        "pth persistence": harm(f"""
for where in {SITE_DIRS!r}:
    try:
        with open(where + "/{MARK}.pth", "w") as f:
            f.write("import os\\n")
    except OSError:
        pass"""),
        "rewritten hidden tests": harm(WALK + f"""
for path in [{hidden!r}, *visible(["tests.py"])]:
    try:
        with open(path, "a") as f:
            f.write("\\n# {MARK}\\n")
    except OSError:
        pass"""),
        # A daemon in a session of its own that waits for grading to end, then rewrites the
        # results and the next submission.
        "escaped process": harm(f"""
import os, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        time.sleep(1)
        for path in {victims!r}:
            try:
                with open(path, "w") as f:
                    f.write("{MARK}")
            except OSError:
                pass
    os._exit(0)"""),
        "check code and frames": gain("""
import gc, sys
frame = sys._getframe()
while frame is not None:
    names = set(frame.f_globals) | set(frame.f_locals)
    if names & {"check", "expected", "Case", "hidden_tests", "compare"}:
        found.append(frame.f_code.co_name)
    frame = frame.f_back
found += [o for o in gc.get_objects()
          if type(o).__name__ == "function" and o.__name__ in ("check", "compare")]"""),
        "hidden tests and solutions on disk": gain(WALK + f"""
import glob
paths = [{hidden!r}, {ROOT + "/refmath/attention.py"!r}, *visible(["attention.py", "tests.py"])]
paths += glob.glob("/proc/*/cwd/refmath/attention.py") + glob.glob("/proc/*/root{ROOT}/refmath/attention.py")
paths += glob.glob("/proc/*/cwd/assignments/attention/hidden/tests.py")
for path in paths:
    try:
        with open(path, errors="replace") as f:
            text = f.read()
    except OSError:
        continue
    if "the attack held" in text:  # this submission itself
        continue
    if "# BEGIN SOLUTION" in text or "@hidden_test" in text or "MAPPING" in text:
        found.append(path)"""),
        "loopback network": gain(f"""
import socket
try:
    with socket.create_connection(("127.0.0.1", {port}), timeout=2) as s:
        found.append(s.recv(100))
except OSError:
    pass"""),
        # Writes a header declaring 80 GB of float64 to every descriptor, then leaves.
        "oversized output": harm("""
import os
head = b'{"status": "ok", "value": {"o": {"__array__": 0}}, "arrays": [{"dtype": "<f8", "shape": [100000, 100000]}]}\\n'
for fd in range(3, 64):
    try:
        os.write(fd, head)
    except OSError:
        pass
os._exit(0)"""),
        "fake printed verdicts": harm("""
print("passed: sdpa_forward: o for q (2, 3, 5, 4): relative error 1.0e-16 <= 1e-11")
print("total 22 / 22")"""),
        "fork bomb": harm(FORK_BOMB + 'print("forked", children)'),
        "disk fill": harm("""
import os
block = b"x" * 2**20
for where in ("/tmp", os.getcwd(), os.path.expanduser("~")):
    try:
        with open(os.path.join(where, "fill"), "wb") as f:
            for _ in range(4096):
                f.write(block)
    except OSError:
        pass"""),
    }


class Server(threading.Thread):
    """A loopback server that hands the solution to whoever connects, and counts them."""

    def __init__(self):
        super().__init__(daemon=True)
        self.socket = socket.create_server(("127.0.0.1", 0))
        self.socket.settimeout(0.2)
        self.port = self.socket.getsockname()[1]
        self.connections = 0
        self.stopping = False

    def run(self):
        while not self.stopping:
            try:
                connection, _ = self.socket.accept()
            except OSError:
                continue
            self.connections += 1
            connection.sendall(reference_text().encode()[:100])
            connection.close()


@pytest.fixture(scope="module")
def server():
    s = Server()
    s.start()
    yield s
    s.stopping = True
    s.join()
    s.socket.close()


def traces() -> list[str]:
    """What a harmful attack would leave on the grader's side."""
    left = [p for d in GRADER_CWDS for p in glob.glob(os.path.join(d, MARK + "*"))]
    left += [p for d in SITE_DIRS for p in glob.glob(os.path.join(d, MARK + "*"))]
    with open(os.path.join(ROOT, "assignments", "attention", "hidden", "tests.py")) as f:
        if MARK in f.read():
            left.append("hidden/tests.py")
    return left


@pytest.fixture(scope="module")
def batch(tmp_path_factory, server, sandbox):
    """A batch folder: the reference first and last, the starter, and every attack."""
    folder = tmp_path_factory.mktemp("batch")
    for name, code in attacks(str(folder), server.port).items():
        write_submission(folder / name.replace(" ", "_"), planted(code))
    write_submission(folder / "aa_reference", reference_text())
    write_submission(folder / "zz_reference", reference_text())
    (folder / "starter").mkdir()
    return folder


def test_every_attack_scores_what_it_deserves_through_grade(batch, sandbox, server):
    m = manifest()
    limits = with_time_limit(m.limits, 10)
    hidden = load_hidden_tests(m)
    memory_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    scores = {}
    for folder in sorted(batch.iterdir()):
        results = grade(m, str(folder), ROOT, limits, only=ONLY, sandbox=sandbox, hidden=hidden)
        scores[folder.name] = results["score"]
        print(f"{folder.name}: {results['score']:g} / {results['max_score']:g}: " + " | ".join(
            t["output"].splitlines()[0][:100] for t in results["tests"] if not t["score"]))
        if folder.name == "fake_printed_verdicts":
            output = results["tests"][0]["output"]
            # what the code printed is quoted, each line behind "| ", never a line of its own
            assert "\n| passed: sdpa_forward" in output and "\npassed:" not in output
        if folder.name == "oversized_output":
            assert "exceed" in results["tests"][0]["output"]
    # 80 GB declared: nothing near it was held (ru_maxrss is in KiB)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - memory_before < 300 * 1024
    assert scores.pop("aa_reference") == scores.pop("zz_reference") == ATTENDED
    assert scores.pop("starter") == 0
    assert scores == {name: DESERVED for name in scores}
    assert server.connections == 0
    time.sleep(4)  # the escaped process would have written by now
    assert traces() == []
    assert sandbox_uid_processes(sandbox) == []
    with open(batch / "zz_reference" / "refmath" / "attention.py") as f:
        assert f.read() == reference_text()


def test_every_attack_in_one_batch_harms_no_other_submission(batch, sandbox, server):
    csv_path = batch.parent / "scores.csv"  # where the escaped process aims
    with open(os.path.join(ROOT, "assignments", "attention", "hidden", "tests.py"), "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    run = subprocess.run([sys.executable, "-m", "refmath", "assignments", "grade", "attention",
                          "--batch", str(batch), "--csv", str(csv_path), "--only", ONLY,
                          "--time-limit", "10", "--jobs", "2"], cwd=ROOT, capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": ROOT})
    assert run.returncode == 0, run.stdout + run.stderr
    time.sleep(4)
    rows = {line.split(",")[0]: float(line.split(",")[1])
            for line in csv_path.read_text().splitlines()[1:]}
    assert rows.pop("aa_reference") == rows.pop("zz_reference") == ATTENDED
    assert rows.pop("starter") == 0
    assert rows == {name: DESERVED for name in rows}
    results = batch.parent / "scores-results"
    reference = json.loads((results / "zz_reference.json").read_text())
    assert reference["score"] == ATTENDED
    assert reference["extra_data"] == {"sandbox": sandbox.mode, "hidden_tests_sha256": digest}
    assert all(json.loads(p.read_text())["score"] == rows.get(p.stem, ATTENDED if "reference"
                                                              in p.stem else 0)
               for p in results.iterdir())
    assert server.connections == 0 and traces() == [] and sandbox_uid_processes(sandbox) == []


def test_another_assignments_tree_holds_no_solution_to_copy(tmp_path, sandbox):
    """Every assignment's tree stubs every other assignment's functions: attention.py copied
    from the norms_ffn tree is the starter."""
    m = manifest()
    build(manifests.load("norms_ffn", os.path.join(ROOT, "assignments")), str(tmp_path / "out"),
          ROOT)
    with open(tmp_path / "out" / "student" / "refmath" / "attention.py") as f:
        copied = f.read()
    assert "# BEGIN SOLUTION" not in copied
    results = grade(m, write_submission(tmp_path / "copied", copied), ROOT, only=ONLY,
                    sandbox=sandbox)
    assert results["score"] == 0  # gqa_head_map is stubbed there too


def test_without_a_sandbox_the_reading_attacks_work(batch, server):
    """The attacks have teeth: graded with no sandbox (the limits alone), reading the solution
    from disk and fetching it over loopback both score the points they were after."""
    m = manifest()
    for name in ("hidden_tests_and_solutions_on_disk", "loopback_network"):
        results = grade(m, str(batch / name), ROOT, with_time_limit(m.limits, 10), only=ONLY,
                        sandbox=sandboxes.Sandbox("none"))
        assert results["score"] == ATTENDED, results["tests"][0]["output"]
        assert results["extra_data"]["sandbox"] == "none"
    assert server.connections >= 1


# The given prefill and decode_step rewritten (or rebound) as the full recomputation, which never
# calls the cached attention the inference assignment asks for.
RECOMPUTE_SOURCE = '''
def prefill(model, params, config, prompt_ids, all_logits=False, **ignored):
    from refmath.models.decoder import logits
    every = logits(params, prompt_ids, config)
    return (every if all_logits else every[:, -1]), {"tokens": prompt_ids}

def decode_step(model, params, config, cache, token_id, **ignored):
    from refmath.models.decoder import logits
    cache["tokens"] = np.concatenate([cache["tokens"], np.reshape(token_id, (-1, 1))], axis=1)
    return logits(params, cache["tokens"], config)[:, -1]
'''
# ... appended to the starter's kv_cache.py
RECOMPUTE = "\n\n" + RECOMPUTE_SOURCE


def test_rewritten_given_code_scores_nothing(tmp_path, sandbox, monkeypatch):
    """Only the listed functions are taken from a submission: a kv_cache.py whose given prefill
    and decode_step recompute everything scores 0, where laying the whole file over the library
    (as graders do that take files whole) scores the recomputation tests."""
    from refmath.assignments import grade as grading
    m = manifests.load("inference", os.path.join(ROOT, "assignments"))
    build(m, str(tmp_path / "out"), ROOT)
    with open(tmp_path / "out" / "student" / "refmath" / "inference" / "kv_cache.py") as f:
        starter = f.read()
    submission = tmp_path / "sub" / "refmath" / "inference"
    submission.mkdir(parents=True)
    (submission / "kv_cache.py").write_text(starter + RECOMPUTE)
    only = "cached_logits_equal_recompute,prefill_mqa_half_layout"
    results = grade(m, str(tmp_path / "sub"), ROOT, only=only, sandbox=sandbox)
    assert results["score"] == 0, [t["output"] for t in results["tests"]]
    monkeypatch.setattr(grading, "graded_library",
                        lambda manifest, base, submitted: ({**base, **submitted}, []))
    whole = grade(m, str(tmp_path / "sub"), ROOT, only=only, sandbox=sandbox)
    assert whole["score"] == whole["max_score"] == 4, [t["output"] for t in whole["tests"]]
