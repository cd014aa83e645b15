"""Speculative decoding: drafters (n-gram, draft model, EAGLE-3) and acceptance."""
