"""Course assignments built from the reference: ``python -m refmath assignments --help``.

``manifest`` reads ``assignments/<name>/assignment.toml``; ``build`` writes the student tree and
the autograder bundle (with the leak check); ``extract`` takes only the listed functions from a
submitted file; ``sandbox`` runs one hidden test's student side (``driver``) confined, and
``wire`` carries its inputs in and its arrays out; ``grade`` scores submissions; ``checks`` is
what hidden tests are made of and compare with. The command line is
:mod:`refmath.commands.assignments`.
"""
