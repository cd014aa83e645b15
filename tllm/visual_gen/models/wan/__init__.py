"""Wan 2.1 / 2.2 (Alibaba): text to video."""
