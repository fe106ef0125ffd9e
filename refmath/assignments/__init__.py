"""Course assignments built from the reference: ``python -m refmath assignments --help``.

``manifest`` reads ``assignments/<name>/assignment.toml``; ``build`` writes the student tree and
the autograder bundle (with the leak check); ``sandbox`` runs one hidden test in a limited process;
``grade`` scores submissions; ``checks`` is what hidden tests use to compare a submission's
outputs with independently computed expectations; ``cli`` is the command line.
"""
