"""Cosmos 3 (NVIDIA): text/image to video (and sound) with a mixture-of-transformers."""
