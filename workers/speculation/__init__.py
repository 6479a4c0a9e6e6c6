"""Speculative decoding: the methods registry (`methods.py`), one proposer a file (`ngram.py`, `draft_model.py`,
`suffix.py`, `eagle/`), lossless verification and sampling, the goodput planner and the in-process engine."""
