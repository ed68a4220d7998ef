"""What checks opencood rather than runs it: ``reference_impls``, the plain-Python definitions
the tests prove the vectorised code equal to and ``tools/bench.py`` times it against."""
