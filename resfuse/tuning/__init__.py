"""Tuning: measured choices of provider and kernel config per fused op, remembered in a SQLite cache.

choose.py (the runtime entry: Call, choose, configure, tune), select.py (two-stage selection with an
injected benchmarker), space.py (configs per level), cache.py (the persistent store and its key).
Nothing is imported here: cache.py must work where Triton is not installed.
"""
