"""The parts of ``python -m jaxdist.profile``: ``trace`` reads the per-process traces,
``report`` turns them into the breakdown, bound, collectives, predicted times and
stragglers, ``advice`` picks what to try, ``plot`` draws the PNG.

The definitions (step window, compute, exposed / overlapped communication, data wait,
idle, the bound rule) are documented once, in ``jaxdist/profile.py``.
"""
