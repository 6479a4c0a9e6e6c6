"""Speculative decoding math and drafters: proposals, lossless verification, sampling, k adaptation, the in-process engine."""
