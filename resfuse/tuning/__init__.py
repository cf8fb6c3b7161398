"""Tuning: measured choices of provider and kernel config per fused op, remembered in a SQLite cache.

cache.py (the persistent store and its key) and select.py (two-stage selection with an injected benchmarker).
"""
