"""Inference-time caches and decoding: the KV cache, its paged and quantised forms, generation."""
