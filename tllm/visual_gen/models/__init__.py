"""Visual-generation model families, one package each."""
