"""DeepSeek-V2/V3 (and models of their architecture: Kimi-K2, Moonlight): multi-head latent
attention over a compressed latent KV cache (attention.py), grouped top-k routing with shared
experts (moe.py), dense first layers (model.py), and
V3's multi-token-prediction module as a draft head (mtp.py)."""
