"""minillama: a small, readable Llama inference engine that owns its (quantized) KV cache.

The public API, each piece a plain function or class you can call from Python:

    from minillama import load_model, KVCache, parse_kv, generate, SamplingParams
    lm = load_model("weights/smollm2-135m-instruct")            # or an HF repo id
    cache = KVCache.for_model(lm.config, parse_kv("hadv2"), capacity=4096)
    ids = lm.tokenizer.encode("The capital of France is")
    for token, stats in generate(lm.model, ids, cache, 20, SamplingParams(temperature=0)):
        print(lm.tokenizer.decode([token]), end="")
"""

from minillama.kv.cache import KVCache
from minillama.app.chat import ChatSession
from minillama.kv.codecs import CODECS
from minillama.kv.spec import PRESETS, KVSpec, parse_kv
from minillama.model.fetch import fetch_default
from minillama.model.generate import decode_step, generate, prefill
from minillama.model.loader import load_model
from minillama.eval.perplexity import evaluate as perplexity
from minillama.model.sampling import SamplingParams

__all__ = ["CODECS", "PRESETS", "ChatSession", "KVCache", "KVSpec", "SamplingParams", "decode_step", "fetch_default",
           "generate", "load_model", "parse_kv", "perplexity", "prefill"]
