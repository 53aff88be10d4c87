"""The model wing: a Llama that takes its KV cache as an argument, and what it needs.

``config`` (HF config.json) -> ``rope`` -> ``attention`` (the reference attention over the
cache) -> ``linear`` -> ``llama`` (the model) -> ``loader`` / ``fetch`` / ``tokenizer``
(getting a model and its text in) -> ``sampling`` and ``generate`` (prefill, decode step,
generation). Imports only from ``minillama.kv`` below it.
"""
