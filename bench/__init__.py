"""Benchmark of the MindIE-on-Triton stack against its peers (``python -m bench.run``)."""
