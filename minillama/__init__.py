"""minillama: a small, readable Llama inference engine that owns its (quantized) KV cache.

The public API, each piece a plain function or class you can call from Python:

    from minillama import load_model, KVCache, parse_kv, generate, GenerateOptions, SamplingParams
    lm = load_model("weights/smollm2-135m-instruct")            # or an HF repo id
    cache = KVCache.for_model(lm.config, parse_kv("hadv2"), capacity=4096)
    ids = lm.tokenizer.encode("The capital of France is")
    options = GenerateOptions(max_new_tokens=20, sampling=SamplingParams(temperature=0))
    for token, stats in generate(lm.model, ids, cache, options):
        print(lm.tokenizer.decode([token]), end="")

A prompt's cache as a file, reused by another process (model/prompt_cache.py):

    logits = prefill(lm.model, ids, cache)[0]                    # (V,)
    save_prompt_cache(lm, cache, ids, "doc.kv", logits)          # atomic; checked when loaded
    saved = load_prompt_cache(lm, "doc.kv", "hadv2")             # CacheFileError (one line) if it cannot be used
    cache, reused, logits = reuse_prefix(saved, ids)             # reused == len(ids): nothing to prefill
    run = Completion(lm, ids, parse_kv("hadv2"), options, prompt_cache="doc.kv")  # all of it, as the CLI

``set_backend("reference")`` runs everything as plain PyTorch (native/backend.py).
"""

# Each public name and the module it lives in, imported on first use (PEP 562): importing one
# part of the package (say minillama.model.generate) loads only what that part needs.
_PUBLIC = {
    "ChatSession": "minillama.app.chat",
    "fetch_default": "minillama.app.default_model",
    "perplexity": ("minillama.eval.perplexity", "evaluate"),
    "KVCache": "minillama.kv.cache",
    "CODECS": "minillama.kv.codecs",
    "Codec": "minillama.kv.codecs",
    "register": "minillama.kv.codecs",
    "Cache": "minillama.kv.interface",
    "PRESETS": "minillama.kv.spec",
    "KVSpec": "minillama.kv.spec",
    "parse_kv": "minillama.kv.spec",
    "GenerateOptions": "minillama.model.generate",
    "decode_step": "minillama.model.generate",
    "generate": "minillama.model.generate",
    "prefill": "minillama.model.generate",
    "load_model": "minillama.native.fast",  # the core loader's, its model on the compiled path
    "Completion": "minillama.model.prompt_cache",
    "load_prompt_cache": "minillama.model.prompt_cache",
    "reuse_prefix": "minillama.model.prompt_cache",
    "save_prompt_cache": "minillama.model.prompt_cache",
    "SamplingParams": "minillama.model.sampling",
    "set_backend": "minillama.native.backend",
    "using": "minillama.native.backend",
}


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'minillama' has no attribute {name!r}")
    import importlib

    where = _PUBLIC[name]
    module, attr = where if isinstance(where, tuple) else (where, name)
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value


__all__ = [
    "CODECS",
    "PRESETS",
    "Cache",
    "ChatSession",
    "Codec",
    "Completion",
    "GenerateOptions",
    "KVCache",
    "KVSpec",
    "SamplingParams",
    "decode_step",
    "fetch_default",
    "generate",
    "load_model",
    "load_prompt_cache",
    "parse_kv",
    "perplexity",
    "prefill",
    "register",
    "reuse_prefix",
    "save_prompt_cache",
    "set_backend",
    "using",
]
