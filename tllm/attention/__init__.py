from tllm.attention.interface import (AttentionBackend, AttentionMetadata,
                                      get_attention_backend, register_attention_backend)

__all__ = ["AttentionBackend", "AttentionMetadata", "get_attention_backend",
           "register_attention_backend"]
