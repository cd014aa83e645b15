"""LTX-2: joint video + audio generation (diffusers' LTX2Pipeline on our framework)."""
