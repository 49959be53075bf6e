"""Peer benchmarks and their figures: the harness behind ``tools/benchmark.py`` (``bench``,
``meter``, the ``open_clip_peer`` and ``lightly_peer``) and standalone scripts.

Imported with the repository root on ``sys.path`` (``tools/benchmark.py`` and the tests put it
there); the ``mmssl`` package never imports it.
"""
