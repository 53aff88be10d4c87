"""The evaluation wing: what a KV cache costs, measured on the cached path.

``datasets`` (evaluation texts) -> ``perplexity`` (cached-path and blind perplexity, KL
divergence) -> ``frontier`` (the bits-vs-quality plot) and ``bench`` (decode speed).
Imports only from ``minillama.model`` and ``minillama.kv`` below it.
"""
