"""Measurement code: the counters and simulations behind ``scripts/`` and the figures under ``docs/``.

Not part of the installed package (``pyproject.toml`` installs ``titan_cp`` only): run the scripts and
tests from a checkout, whose root puts ``benchmarks`` on the import path.
"""
