#!/usr/bin/env bash
# Build the documentation site with warnings as errors, check its internal links, and check it in
# headless Chromium (installing Debian's chromium package first where apt-get is there and we are
# root). Run from anywhere; the venv with the 'docs' extra must be active.
#
# Usage: bash docs/build_and_check.sh [--no-browser]
#   --no-browser   build and link-check only
set -euo pipefail
case "${1:-}" in
    -h|--help) sed -n '2,7p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    --no-browser) browser=0 ;;
    "") browser=1 ;;
    *) echo "unknown option $1 (see --help)" >&2; exit 2 ;;
esac
cd "$(dirname "$0")/.."

start=$(date +%s)
python -m sphinx -W -q -b html docs docs/_build/html
echo "site built in $(( $(date +%s) - start )) s: docs/_build/html/index.html"
python docs/check_links.py docs/_build/html
# The default build is the students' site: no line of a lesson's solutions, and no check cell's
# source, may reach its pages.
answers=$(python -c 'import os, sys; sys.path.insert(0, "docs/_ext")
from lesson_pages import answers_wanted; print(int(answers_wanted(os.environ)))')
if [ "$answers" = 1 ]; then
    echo "instructor build (REFMATH_DOCS_ANSWERS): the answers are shown on purpose, no leak scan"
else
    python docs/check_student_site.py --site docs/_build/html
fi

[ "$browser" = 1 ] || exit 0
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "installing chromium with apt-get for the browser check"
    { apt-get install -y -qq chromium || { apt-get update -qq && apt-get install -y -qq chromium; }; } \
        >/dev/null 2>&1 || echo "apt-get could not install chromium"
fi
if command -v chromium >/dev/null 2>&1; then
    # A bound on the whole check, should the browser hang.
    timeout 600 python docs/browser_check.py --site docs/_build/html --out docs/screenshots
else
    echo "browser check SKIPPED: no chromium on this machine and it could not be installed"
fi
