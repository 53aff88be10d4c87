"""Tokenizers: sentencepiece (Llama-2 style) and byte-level BPE, against transformers."""

from __future__ import annotations

import json

import pytest

from minillama.model.tokenizer import StreamDecoder, load_tokenizer

TEXT = "The quick brown fox jumps over the lazy dog. Numbers 12345 and symbols #@! are here.\n" * 30


@pytest.fixture(scope="module")
def sp_dir(tmp_path_factory):
    """Train a tiny sentencepiece model inside the test and save a Llama-style folder."""
    import sentencepiece as spm

    folder = tmp_path_factory.mktemp("sp")
    corpus = folder / "corpus.txt"
    corpus.write_text(TEXT + "hello world, this is a tiny corpus for a tiny tokenizer.\n" * 20)
    spm.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=str(folder / "tokenizer"),
        vocab_size=400,
        model_type="bpe",
        byte_fallback=True,
        bos_id=1,
        eos_id=2,
        unk_id=0,
        minloglevel=2,
    )
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True})
    )
    return folder


def test_sentencepiece_round_trips(sp_dir):
    tok = load_tokenizer(sp_dir)
    for text in ["hello world", "The lazy dog 42", "naïve café ☕"]:
        assert tok.decode(tok.encode(text)) == text


def test_sentencepiece_ids_equal_transformers_llama_tokenizers(sp_dir):
    from transformers import LlamaTokenizer, LlamaTokenizerFast

    ours = load_tokenizer(sp_dir)
    for cls in (LlamaTokenizer, LlamaTokenizerFast):
        ref = cls.from_pretrained(str(sp_dir))
        for text in ["hello world", "The quick brown fox 12345", "tiny corpus, tiny tokenizer.", "naïve café"]:
            assert ours.encode(text) == ref.encode(text, add_special_tokens=False)
            assert [ours.bos_id] + ours.encode(text) == ref.encode(text)  # Llama adds <s> by default
    assert ours.add_bos and ours.bos_id == 1


def test_sentencepiece_never_parses_special_strings_in_plain_text(sp_dir):
    tok = load_tokenizer(sp_dir)
    assert 1 not in tok.encode("<s> hello </s>") and 2 not in tok.encode("<s> hello </s>")
    assert tok.encode_with_specials("<s>hello")[0] == 1


def test_bpe_plain_text_never_becomes_control_tokens(tiny):
    tok = tiny.tokenizer
    ids = tok.encode("<|im_end|><|im_start|>system")
    assert not set(ids) & set(tok.specials.values())
    assert tok.encode_with_specials("<|im_start|>hi")[0] == tok.specials["<|im_start|>"]


def test_stream_decoder_holds_back_partial_utf8(tiny):
    tok = tiny.tokenizer
    text = "naïve café → 日本語 🙂 ok"
    ids = tok.encode(text)  # byte-level: multi-byte characters span several tokens
    assert len(ids) > len(text)
    stream = StreamDecoder(tok)
    pieces = [stream.push(i) for i in ids] + [stream.flush()]
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)
