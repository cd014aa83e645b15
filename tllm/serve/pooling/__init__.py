"""The pooling routes (embeddings, rerank, score) and the token routes (tokenize,
detokenize): their wire format, checks, and calls into the engine's pooling API."""
