"""Benchmarks: the serving load generator (`tllm bench serve`)."""
