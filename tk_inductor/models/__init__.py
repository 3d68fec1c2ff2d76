"""Built-in models in plain PyTorch (no download, no transformers): the demo\x27s Llama, the Based LM."""
