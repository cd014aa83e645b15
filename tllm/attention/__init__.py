from tllm.attention.interface import (AttentionBackend, AttentionMetadata, KVCacheSpec,
                                      get_attention_backend, has_attention_backend,
                                      register_attention_backend)

__all__ = ["AttentionBackend", "AttentionMetadata", "KVCacheSpec", "get_attention_backend",
           "has_attention_backend", "register_attention_backend"]
