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

from minillama.app.chat import ChatSession
from minillama.app.default_model import fetch_default
from minillama.eval.perplexity import evaluate as perplexity
from minillama.kv.cache import KVCache
from minillama.kv.codecs import CODECS, Codec, register
from minillama.kv.interface import Cache
from minillama.kv.spec import PRESETS, KVSpec, parse_kv
from minillama.model.generate import GenerateOptions, decode_step, generate, prefill
from minillama.model.loader import load_model
from minillama.model.prompt_cache import Completion, load_prompt_cache, reuse_prefix, save_prompt_cache
from minillama.model.sampling import SamplingParams
from minillama.native.backend import set_backend, using

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
