"""Reliability suite: faults (SIGKILL, full and read-only file systems), load (many processes, soak) and
hostile input (fuzzed entries, planted pickles, other users) against the whole package at once.

See docs/reliability.md for what each test proves, how to run the long forms, and the last figures.
"""
