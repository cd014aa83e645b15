"""Qwen-Image and Qwen-Image-Layered: pipelines, components and transformer."""
