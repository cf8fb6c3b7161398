"""Kernel numerics tests (run under the interpreter; see conftest.py)."""
