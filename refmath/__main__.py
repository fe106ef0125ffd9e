"""``python -m refmath <command>``: the commands are :mod:`refmath.commands`."""
import sys

from refmath.commands import main

if __name__ == "__main__":
    sys.exit(main())
