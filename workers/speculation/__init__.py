"""Speculative decoding: drafters, lossless verification, sampling, k adaptation and the in-process engine."""
