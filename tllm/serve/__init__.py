"""`tllm serve`: an OpenAI-compatible HTTP server over the LLM API (build_app in
openai_server.py), with Prometheus metrics."""
