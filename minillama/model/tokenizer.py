"""Tokenizers: byte-level BPE (``tokenizer.json``) or sentencepiece (``tokenizer.model``).

Plain text is always encoded as plain text: a user typing ``<|im_end|>`` gets the
ordinary tokens for those characters, never the control token. Special tokens enter
only through ``encode_with_specials``, which the chat template path uses on text the
template produced (the special strings are matched there, everything else is plain).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from minillama.errors import UserError, shown


def _content(tok) -> str | None:
    return tok.get("content") if isinstance(tok, dict) else tok


@dataclass
class Tokenizer:
    backend: object
    kind: str  # "bpe" | "sentencepiece"
    specials: dict[str, int] = field(default_factory=dict)  # special token string -> id
    bos_token: str | None = None
    eos_token: str | None = None
    add_bos: bool = False
    chat_template: str | None = None

    @property
    def bos_id(self) -> int | None:
        return self.specials.get(self.bos_token) if self.bos_token else None

    def encode(self, text: str) -> list[int]:
        """Plain text -> ids, with no special tokens added or parsed."""
        if not text:
            return []
        if self.kind == "bpe":
            return self.backend.encode(text, add_special_tokens=False).ids
        return self.backend.encode(text)

    def encode_with_specials(self, text: str) -> list[int]:
        """Template output -> ids: special token strings become their ids, the rest is plain."""
        if not self.specials:
            return self.encode(text)
        pattern = "(" + "|".join(re.escape(s) for s in sorted(self.specials, key=len, reverse=True)) + ")"
        ids: list[int] = []
        for piece in re.split(pattern, text):
            ids.extend([self.specials[piece]] if piece in self.specials else self.encode(piece))
        return ids

    def decode(self, ids: list[int]) -> str:
        if self.kind == "bpe":
            return self.backend.decode(ids, skip_special_tokens=False)
        return self.backend.decode(ids)


class StreamDecoder:
    """Turns a stream of token ids into text, holding back bytes of unfinished characters.

    Byte-level BPE splits multi-byte UTF-8 characters across tokens; decoding each token
    alone would print replacement characters. We decode a sliding window and only emit
    text once it no longer ends in an incomplete character (as HF's TextStreamer does).
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tok = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # window start
        self.read = 0  # ids already turned into emitted text

    def push(self, token: int) -> str:
        self.ids.append(token)
        before = self.tok.decode(self.ids[self.prefix : self.read])
        after = self.tok.decode(self.ids[self.prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return after[len(before) :]
        return ""

    def flush(self) -> str:
        before = self.tok.decode(self.ids[self.prefix : self.read])
        rest = self.tok.decode(self.ids[self.prefix :])[len(before) :]
        self.prefix = self.read = len(self.ids)
        return rest


def read_json(path: Path, default: dict | None = None) -> dict:
    """A JSON object from a model folder's file (`default` when the file is absent); a UserError
    naming the file when it is not a readable JSON object."""
    if not path.exists():
        if default is None:
            raise UserError(f"{path} not found")
        return default
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise UserError(f"{path} is not valid JSON ({str(e)[:100]})") from None
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror or e}") from None
    if not isinstance(data, dict):
        raise UserError(f"{path} must hold a JSON object, not a {type(data).__name__}")
    return data


def _template(cfg: dict, where: Path) -> str | None:
    """The chat template of tokenizer_config.json: a string, or HF's list of named templates."""
    template = cfg.get("chat_template")
    if isinstance(template, list):  # HF allows named templates; take the default one
        named = [t for t in template if isinstance(t, dict) and isinstance(t.get("template"), str)]
        if not named:
            raise UserError(f"{where}: chat_template is a list without {{name, template}} entries")
        template = next((t["template"] for t in named if t.get("name") == "default"), named[0]["template"])
    if template is not None and not isinstance(template, str):
        raise UserError(f"{where}: chat_template must be a string, not {shown(template)}")
    return template


def load_tokenizer(folder: Path) -> Tokenizer:
    folder = Path(folder)
    cfg_path = folder / "tokenizer_config.json"
    cfg = read_json(cfg_path, {})
    bos, eos = _content(cfg.get("bos_token")), _content(cfg.get("eos_token"))
    for name, value in (("bos_token", bos), ("eos_token", eos)):
        if value is not None and not isinstance(value, str):
            raise UserError(
                f"{cfg_path}: {name} must be a string or an object with a content string, not {shown(value)}"
            )
    template = _template(cfg, cfg_path)
    if (folder / "chat_template.jinja").exists():
        template = (folder / "chat_template.jinja").read_text(encoding="utf-8", errors="replace")
    if (folder / "tokenizer.json").exists():
        from tokenizers import Tokenizer as HFTokenizer

        path = folder / "tokenizer.json"
        try:
            backend = HFTokenizer.from_file(str(path))
        except Exception as e:  # the tokenizers library raises a bare Exception for any bad file
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:100]
            raise UserError(f"{path} is not a tokenizer the tokenizers library can read ({reason})") from None
        backend.encode_special_tokens = True  # never parse special strings inside plain text
        specials = {t.content: i for i, t in backend.get_added_tokens_decoder().items() if t.special}
        add_bos = bool(cfg.get("add_bos_token", False))
        tok = Tokenizer(backend, "bpe", specials, bos, eos, add_bos, template)
    elif (folder / "tokenizer.model").exists():
        import sentencepiece as spm

        path = folder / "tokenizer.model"
        try:
            backend = spm.SentencePieceProcessor(model_file=str(path))
        except Exception as e:  # sentencepiece raises RuntimeError/OSError with a C++ message
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:100]
            raise UserError(f"{path} is not a sentencepiece model ({reason})") from None
        specials = {}
        for i in (backend.bos_id(), backend.eos_id(), backend.unk_id()):
            if i >= 0:
                specials[backend.id_to_piece(i)] = i
        bos = bos or (backend.id_to_piece(backend.bos_id()) if backend.bos_id() >= 0 else None)
        eos = eos or (backend.id_to_piece(backend.eos_id()) if backend.eos_id() >= 0 else None)
        add_bos = bool(cfg.get("add_bos_token", True))  # Llama-2 tokenizers add <s> by default
        tok = Tokenizer(backend, "sentencepiece", specials, bos, eos, add_bos, template)
    else:
        raise UserError(f"{folder} has no tokenizer.json or tokenizer.model: add the model's tokenizer files")
    return tok
