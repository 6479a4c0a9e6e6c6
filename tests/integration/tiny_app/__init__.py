"""Tests that share one Serve app on the tiny pair (conftest.py)."""
