"""EAGLE-3 drafting (methods "eagle", "eagle+ngram", "eagle-tree"): the head's config (`config.py`, torch-free), its
layers (`head.py`), its checkpoint on disk (`checkpoint.py`), its batched cached drafting (`drafting.py`) and dynamic
trees (`tree.py`), the EagleDrafter (`drafter.py`), and the one place a head becomes a drafter (`loading.py`)."""
