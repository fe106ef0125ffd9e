"""Open the built site in headless Chromium and check that it renders: maths typeset by MathJax,
no raw TeX left, every image loaded, no code or output wider than its column; save a screenshot of
each page checked.

Usage: python docs/browser_check.py [--site docs/_build/html] [--out docs/screenshots]

The site is served from 127.0.0.1 only. Chromium (Debian's ``chromium`` package) is driven over
the DevTools protocol on a pipe (``--remote-debugging-pipe``), so nothing beyond the standard
library is needed. Pages checked: the landing page, every lesson (each cell that calls
``plt.show()`` must show its figure), the architecture diagrams, the API page of
``refmath.attention`` and the catalogue.
Exit status 0 when every check passes, 1 when one fails, 2 when no Chromium is found.
"""
from __future__ import annotations

import argparse
import base64
import functools
import http.server
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

# Runs in the page: waits for MathJax to finish typesetting and for every image to settle, then
# reports what a reader would see. Math that MathJax has not typeset keeps its TeX delimiters.
INSPECT_PAGE = """
(async () => {
  const sleep = ms => new Promise(r => setTimeout(r, ms));
  const hasMath = document.querySelector('.math') !== null;
  for (let i = 0; hasMath && i < 300 && !(window.MathJax && MathJax.startup && MathJax.startup.promise); i++)
    await sleep(100);
  if (window.MathJax && MathJax.startup) await MathJax.startup.promise;
  await Promise.all([...document.images].map(img => img.complete ? null :
    new Promise(r => { img.addEventListener('load', r); img.addEventListener('error', r); })));
  const walker = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
  const raw = [];
  for (let n = walker.nextNode(); n; n = walker.nextNode()) {
    if (n.parentElement.closest('pre, code, script, style, mjx-container, .highlight')) continue;
    if (/\\$\\$|\\\\\\(|\\\\\\[/.test(n.textContent)) raw.push(n.textContent.trim().slice(0, 80));
  }
  return {
    mathElements: document.querySelectorAll('.math').length,
    typeset: document.querySelectorAll('mjx-container').length,
    untypeset: [...document.querySelectorAll('.math')].filter(e => !e.querySelector('mjx-container')).length,
    mathErrors: [...document.querySelectorAll('mjx-merror')].map(e => e.textContent).slice(0, 5),
    rawTex: raw.slice(0, 5),
    images: [...document.images].map(img => ({src: img.getAttribute('src'), width: img.naturalWidth})),
    figures: document.querySelectorAll('.cell_output img').length,
    // Cells that call plt.show() but show no image: a figure lost (under the Agg backend, say).
    cellsWithoutFigure: [...document.querySelectorAll('div.cell')].filter(cell => {
      const code = cell.querySelector('.cell_input');
      return code && code.textContent.includes('plt.show()') && !cell.querySelector('.cell_output img');
    }).length,
    // Code or output wider than the column it sits in: cut off at the column's right edge.
    overflowing: [...document.querySelectorAll('div.highlight pre, div.cell_output pre')]
      .filter(pre => pre.scrollWidth > pre.clientWidth + 1).length,
    height: document.documentElement.scrollHeight,
  };
})()
"""


class DevTools:
    """A minimal DevTools client over Chromium's debugging pipe (fd 3 in, fd 4 out, NUL-framed)."""

    def __init__(self, chromium: str, profile: str):
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()

        def wire_fds():  # the browser expects its command pipe on fd 3 and its replies on fd 4
            commands, replies = os.dup(to_browser_r), os.dup(from_browser_w)  # out of the way first
            os.dup2(commands, 3)
            os.dup2(replies, 4)

        self.process = subprocess.Popen(
            [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
             "--remote-debugging-pipe", f"--user-data-dir={profile}", "--hide-scrollbars",
             "--force-device-scale-factor=1", "about:blank"],
            preexec_fn=wire_fds, pass_fds=(3, 4, to_browser_r, from_browser_w),  # 3, 4: kept after
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._buffer = b""
        self._next_id = 0
        self.events: list[dict] = []

    def _read_message(self) -> dict:
        while b"\0" not in self._buffer:
            chunk = os.read(self._from_browser, 1 << 20)
            if not chunk:
                raise RuntimeError("Chromium closed its debugging pipe")
            self._buffer += chunk
        message, _, self._buffer = self._buffer.partition(b"\0")
        return json.loads(message)

    def call(self, method: str, session: str | None = None, **params) -> dict:
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params}
        if session:
            message["sessionId"] = session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        while True:
            reply = self._read_message()
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]
            self.events.append(reply)

    def wait_for(self, event: str, session: str) -> None:
        while True:
            for i, seen in enumerate(self.events):
                if seen.get("method") == event and seen.get("sessionId") == session:
                    del self.events[: i + 1]
                    return
            self.events.append(self._read_message())

    def close(self) -> None:
        try:
            self.call("Browser.close")
        except (RuntimeError, OSError):
            pass
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()


def serve(site: Path) -> http.server.ThreadingHTTPServer:
    """A static server of ``site`` on 127.0.0.1, on a free port, in a background thread."""
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0),
                                             functools.partial(Quiet, directory=str(site)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def pages_to_check(site: Path) -> list[str]:
    """The landing page, every lesson, the architecture diagrams, the API page of
    refmath.attention, the catalogue."""
    lessons = sorted((site / "lessons").glob("*.html"))
    api = next((p for p in sorted((site / "api").glob("*.html"))
                if 'id="refmath.attention.sdpa_forward"' in p.read_text(encoding="utf-8")), None)
    found = [site / "index.html", *lessons, site / "architecture.html", api,
             site / "catalogue.html"]
    return [str(p.relative_to(site)) for p in found if p is not None and p.exists()]


def problems_with(page: str, report: dict) -> list[str]:
    """What is wrong with a page: every page checked must have maths (the lessons write theirs in
    LaTeX), all of it typeset."""
    problems = []
    if report["mathElements"] == 0:
        problems.append("no maths on the page")
    if report["untypeset"]:
        problems.append(f"{report['untypeset']} of {report['mathElements']} maths elements not typeset")
    if report["mathErrors"]:
        problems.append(f"MathJax errors: {report['mathErrors']}")
    if report["rawTex"]:
        problems.append(f"raw TeX left in the text: {report['rawTex']}")
    problems += [f"image not loaded: {img['src']}" for img in report["images"] if img["width"] == 0]
    if report["cellsWithoutFigure"]:
        problems.append(f"{report['cellsWithoutFigure']} cells call plt.show() and show no figure")
    if report["overflowing"]:
        problems.append(f"{report['overflowing']} code blocks or outputs wider than their column")
    return problems


def check_site(site: Path, out: Path, chromium: str) -> int:
    out.mkdir(parents=True, exist_ok=True)
    server = serve(site)
    base = f"http://127.0.0.1:{server.server_address[1]}/"
    failures = 0
    with tempfile.TemporaryDirectory() as profile:
        browser = DevTools(chromium, profile)
        try:
            target = browser.call("Target.createTarget", url="about:blank")["targetId"]
            session = browser.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
            browser.call("Page.enable", session)
            browser.call("Emulation.setDeviceMetricsOverride", session, width=1280, height=900,
                         deviceScaleFactor=1, mobile=False)
            for page in pages_to_check(site):
                browser.call("Page.navigate", session, url=base + page)
                browser.wait_for("Page.loadEventFired", session)
                report = browser.call("Runtime.evaluate", session, expression=INSPECT_PAGE,
                                      awaitPromise=True, returnByValue=True)["result"]["value"]
                shots = [("top", None)]
                if report["figures"]:  # a second view with the first figure in sight
                    shots.append(("figure", "document.querySelector('.cell_output img')"
                                            ".scrollIntoView({block: 'center'})"))
                names = []
                for label, scroll in shots:
                    if scroll:
                        browser.call("Runtime.evaluate", session, expression=scroll)
                    png = browser.call("Page.captureScreenshot", session, format="png")["data"]
                    name = page.replace("/", "_").removesuffix(".html") + f"_{label}.png"
                    (out / name).write_bytes(base64.b64decode(png))
                    names.append(name)
                problems = problems_with(page, report)
                failures += bool(problems)
                loaded = sum(img["width"] > 0 for img in report["images"])
                print(f"{'FAIL' if problems else 'ok  '} {page}: {report['typeset']} of "
                      f"{report['mathElements']} maths typeset, {loaded}/{len(report['images'])} "
                      f"images loaded ({report['figures']} figures); screenshots {', '.join(names)}")
                for problem in problems:
                    print(f"     {problem}")
        finally:
            browser.close()
            server.shutdown()
    return 1 if failures else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--site", default="docs/_build/html", type=Path, help="the built HTML folder")
    parser.add_argument("--out", default="docs/screenshots", type=Path, help="where screenshots go")
    parser.add_argument("--chromium", default=None,
                        help="the browser binary (default: chromium or chromium-browser on PATH)")
    args = parser.parse_args(argv)
    chromium = args.chromium or shutil.which("chromium") or shutil.which("chromium-browser")
    if not chromium:
        print("browser check skipped: no Chromium found (Debian: apt-get install chromium)")
        return 2
    if not (args.site / "index.html").exists():
        print(f"no built site at {args.site}")
        return 1
    return check_site(args.site.resolve(), args.out, chromium)


if __name__ == "__main__":
    sys.exit(main())
