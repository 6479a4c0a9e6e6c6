"""What the tests share: tiny models, GGUF files and EAGLE-3 data made from configs, local workers, the greedy and
sampling oracles, and helpers for served apps. Test modules import from here (fixtures come from conftest.py files);
no test module imports another (tests/test_structure.py)."""
