"""Course assignments built from the reference: ``python -m refmath assignments --help``.

``manifest`` reads ``assignments/<name>/assignment.toml``; ``build`` writes the student tree and
the autograder bundle (with the leak check); ``grade`` scores submissions; ``checks`` is what
hidden tests are made of and compare with. The command line is
:mod:`refmath.commands.assignments`.

Everything a student controls is untrusted input, and each input has one place that bounds it
(the documentation's "grader threat model" page lists them with their tests):

- the files, their names, links and types, sizes and encoding: ``submission`` (read as data,
  ``O_NOFOLLOW`` on every component, regular files only, capped, strict UTF-8);
- the source text: ``extract`` (only the listed definitions, by syntax tree; nothing that runs
  when defined; no reach past the function's own values) and ``installer`` (the submitted
  functions in a namespace of their own, the given module frozen);
- what runs: ``sandbox`` (bubblewrap, or a uid of its own) and ``driver`` (the rlimits, inputs
  only);
- what crosses back: ``wire`` (a bounded format, read against a deadline);
- what it prints, raises and exits with, and every name shown: ``text`` (escaped) and
  ``sandbox.Sandbox._outcome`` (one line each);
- time, memory and processes of a whole test: ``usage`` (read by the grader from the kernel,
  memory bounded per test) beside the rlimits;
- any exception on the way: ``grade`` (that submission's failure, with its reason; a batch always
  grades everyone and writes its CSV row by row).
"""
