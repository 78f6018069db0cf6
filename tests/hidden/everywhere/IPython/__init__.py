"""Not IPython: the suite's processes run as where IPython is not installed (jaxdist does not
depend on it). flax imports it at start-up only to ask whether a notebook wants colours, a
quarter of a second of CPU in each of the few hundred processes the suite starts
(``tests/conftest.py`` puts this folder first on their path)."""

raise ImportError("IPython is hidden from the test suite's processes (tests/hidden/everywhere)")
