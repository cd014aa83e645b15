"""Triton kernels: paged context and decode attention, KV-cache write (with fused RoPE),
RMSNorm (with fused residual add) and SiLU-and-mul. Import the modules directly."""
