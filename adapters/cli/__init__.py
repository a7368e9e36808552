"""The `shadowradix` command line: `run` (end-to-end decode through the runner) and `demo` (the
cache alone).
"""
