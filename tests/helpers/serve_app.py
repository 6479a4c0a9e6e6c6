"""The prompts of tests/cluster/test_serve_app.py: its `reference` fixture holds their target-only outputs, which the
bad-input cases (serve_bad_input_cases.py, star-imported there) compare the next valid request against."""

PROMPTS = ["def add(a, b):", "class Stack:", "for i in range(3):", "import json"]
