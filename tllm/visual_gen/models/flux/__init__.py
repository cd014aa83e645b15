"""FLUX.1 (Black Forest Labs): text to image with double- and single-stream blocks."""
