"""The model wing: a Llama that takes its KV cache as an argument, and what it needs.

``config`` (HF config.json) -> ``rope`` -> ``attention`` (the reference attention over the
cache) -> ``linear`` -> ``weights`` (every weight in one buffer of huge pages) -> ``llama``
(the model, plain PyTorch: the specification) and ``step`` (the one place that chooses the
compiled decode step instead: every layer in one native call)
-> ``loader`` / ``gguf`` / ``tokenizer`` (getting a model and its text in) -> ``sampling`` and
``generate`` (prefill, decode step, generation) -> ``prompt_cache`` (a prompt's cache saved and
reused). Imports only from ``minillama.kv`` and ``minillama.native`` below it; of this wing only
``step`` imports ``minillama.native``.
"""
