"""Chat templates: the model's own jinja2 template rendered with Hugging Face's semantics.

Like ``transformers``' ``apply_chat_template``: an immutable sandboxed jinja2 environment
with ``trim_blocks``/``lstrip_blocks``, the variables ``messages``,
``add_generation_prompt``, ``bos_token``, ``eos_token``, and ``raise_exception`` for
templates that reject a conversation (which becomes a clear error here).

Message contents are always encoded as plain text: we render the template with each
content replaced by a unique placeholder, encode the template's own text with special
tokens parsed, and the user's text without. Typing ``<|im_end|>`` therefore produces
ordinary tokens, never the control token.
"""

from __future__ import annotations

import re
from datetime import datetime

from minillama.errors import UserError
from minillama.model.tokenizer import Tokenizer

# Used when a model ships no template; documented in the README.
FALLBACK_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] | capitalize }}: {{ message['content'] }}\n\n{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)

_PLACEHOLDER = "\ue000{}\ue001"  # private-use characters no template produces by itself
_PLACEHOLDER_RE = re.compile("\ue000(\\d+)\ue001")


def _raise(message):
    raise UserError(f"the chat template refused this conversation: {message}")


def render(
    template: str | None,
    messages: list[dict],
    add_generation_prompt: bool = True,
    bos_token: str | None = "",
    eos_token: str | None = "",
) -> str:
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template or FALLBACK_TEMPLATE).render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token or "",
            eos_token=eos_token or "",
        )
    except UserError:
        raise
    except TemplateError as e:
        raise UserError(f"the chat template failed to render: {e}") from None


def encode_chat(tok: Tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
    """Token ids of the rendered conversation; message contents never become special tokens."""
    masked = [{**m, "content": _PLACEHOLDER.format(i)} for i, m in enumerate(messages)]
    text = render(tok.chat_template, masked, add_generation_prompt, tok.bos_token, tok.eos_token)
    ids: list[int] = []
    pos = 0
    for m in _PLACEHOLDER_RE.finditer(text):
        ids += tok.encode_with_specials(text[pos : m.start()])
        ids += tok.encode(messages[int(m.group(1))]["content"])
        pos = m.end()
    ids += tok.encode_with_specials(text[pos:])
    return ids
