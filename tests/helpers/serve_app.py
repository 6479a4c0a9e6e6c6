"""The prompts of tests/integration/tiny_app/: its `reference` fixture
holds their target-only outputs, which the bad-input cases compare the next valid request against."""

PROMPTS = ["def add(a, b):", "class Stack:", "for i in range(3):", "import json"]
N = 24  # new tokens of their reference outputs
METRICS_REPORT_S = 1  # how often the metric tests' Ray exports each process's metrics (its metrics_report_interval_ms)
