"""The model wing: a Llama that takes its KV cache as an argument, and what it needs.

``config`` (HF config.json) -> ``rope`` -> ``attention`` (the reference attention over the
cache) -> ``linear`` -> ``llama`` (the model, plain PyTorch: the specification) -> ``loader`` /
``gguf`` / ``tokenizer`` (getting a model and its text in) -> ``sampling`` and ``generate``
(prefill, decode step, generation; ``auto``, what ``bits=auto`` measures first) ->
``prompt_cache`` (a prompt's cache saved and reused). Imports only from ``minillama.kv``; the
compiled path (minillama.native) reads this wing, never the other way round.
"""
