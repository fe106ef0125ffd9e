"""Print the README's two commands, one a line: the Quick start's (install, check every gradient)
and the test suite's. They are the first two ```bash blocks under "## Quick start"; .ci/run runs
them verbatim, so the commands a newcomer copies are the ones CI proves."""
import re
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_commands(text: str) -> list[str]:
    section = text.split("\n## Quick start\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, flags=re.S)
    commands = [block.strip() for block in blocks[:2]]
    if len(commands) != 2 or any("\n" in c for c in commands):
        sys.exit("README.md: the Quick start must open with two ```bash blocks of one line each")
    return commands


if __name__ == "__main__":
    print("\n".join(readme_commands(README.read_text(encoding="utf-8"))))
