"""A chat session that keeps its KV cache across turns, and the REPL around it.

Each turn renders the whole conversation with the model's template, compares it with
the tokens the cache already holds, truncates the cache to the common prefix (the cache
may keep a little less when a quantized group would be cut) and prefills only the
rest. The cache itself is the ``KVCache`` ring: when it is full it evicts old tokens and
the chat goes on (or stops clearly with on_full="stop").
"""

from __future__ import annotations

import json
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from minillama.app.chat_template import encode_chat
from minillama.app.options import CHARS_PER_TOKEN_BOUND
from minillama.errors import UserError, shown
from minillama.eval.bench import weight_bytes_per_token
from minillama.kv.cache import KVCache
from minillama.kv.file import CacheFileError, check_replaceable, read, read_header, write_atomic
from minillama.kv.spec import KVSpec, parse_kv
from minillama.model.generate import GenerateOptions, GenerationStats, generate, prefill
from minillama.model.loader import LoadedModel
from minillama.model.prompt_cache import encode_prompt_cache, keep_common_prefix, load_prompt_cache
from minillama.model.sampling import SamplingParams
from minillama.model.tokenizer import StreamDecoder
from minillama.native import backend

DEFAULT_SAMPLING = SamplingParams(temperature=0.7, top_k=0, top_p=0.9, min_p=0.05, repeat_penalty=1.1)


def json_conversation(path: str) -> dict | None:
    """An older /save file: a JSON object with a messages list; None when `path` is not one."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("messages"), list) else None


def check_save_target(path: str) -> None:
    """/save and --prompt-cache replace only a missing file, a minillama cache file or a JSON
    conversation; anything else (notes, a prompt, a model's weights) is refused untouched."""
    try:
        check_replaceable(path)
    except CacheFileError:
        if json_conversation(path) is None:
            raise


def sampling_from_generation_config(
    gen: dict,
    overrides: dict | None = None,
    base: SamplingParams = DEFAULT_SAMPLING,
    where: str = "generation_config.json",
) -> SamplingParams:
    """The sampling settings: `overrides` (the command line's, None = not given) over the model's
    generation_config.json over our documented defaults."""
    given = {k: v for k, v in (overrides or {}).items() if v is not None}
    if gen.get("do_sample") is False:  # greedy, nothing else applied
        gen, base = {}, SamplingParams(temperature=0.0)
    names = {
        "temperature": "temperature",
        "top_k": "top_k",
        "top_p": "top_p",
        "min_p": "min_p",
        "repeat_penalty": "repetition_penalty",
    }
    values = {ours: given.get(ours, gen.get(theirs, getattr(base, ours))) for ours, theirs in names.items()}
    try:
        return SamplingParams(**values)
    except UserError as e:
        raise UserError(f"{where}: {e} (override it with the matching option)") from None


@contextmanager
def sigint_as_flag() -> Iterator[threading.Event]:
    """While generating, Ctrl-C sets a flag checked between tokens, so a cache append is
    never interrupted half way and the cache stays consistent with the history."""
    flag = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return
    previous = signal.signal(signal.SIGINT, lambda *_: flag.set())
    try:
        yield flag
    finally:
        signal.signal(signal.SIGINT, previous)


@dataclass
class TurnStats:
    reused_tokens: int = 0  # tokens the cache held from earlier turns and kept
    prefilled_tokens: int = 0
    generation: GenerationStats | None = None
    interrupted: bool = False
    evicted_tokens: int = 0  # tokens the full ring dropped during this turn

    def line(self) -> str:
        g = self.generation
        text = f"[reused {self.reused_tokens} cached tokens, prefilled {self.prefilled_tokens} new"
        if g:
            text += f" at {g.prefill_tokens_per_s:.1f} tok/s, decoded {g.generated_tokens} at {g.decode_tokens_per_s:.1f} tok/s"
        if self.evicted_tokens:
            text += f", {self.evicted_tokens} oldest evicted"
        return text + (", interrupted]" if self.interrupted else "]")


class ChatSession:
    """A conversation plus the cache holding its tokens; usable from Python or the REPL."""

    def __init__(
        self,
        lm: LoadedModel,
        spec: KVSpec,
        ctx: int | None = None,
        system: str | None = None,
        params: SamplingParams = DEFAULT_SAMPLING,
        seed: int = 0,
        max_tokens: int = 512,
        on_full: str = "evict",
    ):
        self.lm, self.params, self.max_tokens, self.on_full = lm, params, max_tokens, on_full
        self.ctx = ctx or lm.config.max_position_embeddings
        self.generator = torch.Generator(lm.model.device).manual_seed(seed)
        self.messages: list[dict] = [{"role": "system", "content": system}] if system else []
        self.stops = lm.stop_ids()
        self.cache = self._new_cache(spec)
        self.cached_ids: list[int] = []  # every token fed to the cache, in order (evicted ones too)
        self.last = TurnStats()
        self.autosave: str | None = None  # chat --prompt-cache: save the session here after every reply
        self.warn: Callable[[str], None] = lambda message: None  # the REPL prints these on stderr

    def _new_cache(self, spec: KVSpec) -> KVCache:
        return KVCache.for_model(self.lm.config, spec, self.ctx, device=self.lm.model.device, on_full=self.on_full)

    @property
    def prefill_chunk(self) -> int:
        return max(1, min(512, self.ctx // 2))

    def _sync(self, ids: list[int]) -> list[int]:
        """Keep the cached prefix that `ids` shares; return the tokens still to prefill."""
        kept = keep_common_prefix(self.cache, self.cached_ids, ids)
        self.cached_ids = self.cached_ids[:kept]
        return ids[kept:]

    def _check_fits(self, ids: list[int]) -> None:
        """A conversation the cache cannot hold with room for a reply: refused with on_full="stop"
        (the turn is not added), else said once in a warning before the ring drops its start."""
        if len(ids) < self.ctx:
            return
        if self.on_full == "stop":
            self.messages.pop()
            raise UserError(
                f"the conversation with this message is {len(ids):,} tokens and the cache holds {self.ctx:,} "
                "(--ctx): /reset, raise --ctx, or chat with --on-full evict to drop its oldest tokens"
            )
        self.warn(
            f"the conversation is {len(ids):,} tokens and the cache holds {self.ctx:,} (--ctx): its oldest "
            f"{len(ids) - self.ctx + 1:,} or more are evicted and the reply may lose track of them"
        )

    def send(self, text: str) -> Iterator[str]:
        """Add a user turn and stream the reply's text; the reply joins the history."""
        self.messages.append({"role": "user", "content": text})
        ids = encode_chat(self.lm.tokenizer, self.messages, add_generation_prompt=True)
        self._check_fits(ids)
        new = self._sync(ids)
        evicted = self.cache.evicted
        self.last = TurnStats(reused_tokens=self.cache.held, prefilled_tokens=len(new))
        stream = StreamDecoder(self.lm.tokenizer)
        fed = self.cached_ids + new  # grows with every sampled token; the cache's position says how many were fed
        reply: list[int] = []
        try:
            with sigint_as_flag() as interrupted:
                options = GenerateOptions(
                    self.max_tokens, self.params, frozenset(self.stops), self.generator, self.prefill_chunk
                )
                for token, stats in generate(self.lm.model, ids, self.cache, options, held=len(self.cached_ids)):
                    self.last.generation = stats
                    fed.append(token)
                    if token in self.stops:
                        break
                    reply.append(token)
                    yield stream.push(token)
                    if interrupted.is_set():
                        self.last.interrupted = True
                        break
        finally:
            self.cached_ids = fed[: self.cache.position]
            self.last.evicted_tokens = self.cache.evicted - evicted
            self.messages.append({"role": "assistant", "content": self.lm.tokenizer.decode(reply)})
        tail = stream.flush()
        if tail:
            yield tail
        if self.autosave:
            self.save(self.autosave)

    def reset(self) -> None:
        self.messages = [m for m in self.messages if m["role"] == "system"]
        self.cache.reset()
        self.cached_ids = []

    def set_system(self, text: str) -> None:
        self.messages = [{"role": "system", "content": text}] + [m for m in self.messages if m["role"] != "system"]

    def switch_kv(self, spec: KVSpec) -> None:
        """Rebuild the cache in a new scheme by prefilling the conversation's tokens into it.

        The new cache is complete before it replaces the old one, so a failure (a cache that
        does not fit, Ctrl-C during the prefill) leaves the session as it was."""
        cache = self._new_cache(spec)
        if self.cached_ids:
            prefill(self.lm.model, self.cached_ids, cache, self.prefill_chunk)
        self.cache = cache

    def save(self, path: str) -> int:
        """Write the conversation and its cache to one file (kv/file.py), atomically: the old file or
        the new one, never half of it. Only a missing file, a minillama cache file or a JSON
        conversation is replaced (``check_save_target``). Returns the bytes written."""
        check_save_target(path)
        data = encode_prompt_cache(
            self.lm, self.cache, self.cached_ids, extra={"messages": self.messages, "kv": str(self.cache.spec)}
        )
        return write_atomic(path, data)

    def load(self, path: str) -> str:
        """Replace the conversation with one saved by ``save``, and the cache with its cache when it
        was made by this model with this session's --kv (no prefill); otherwise the cache is rebuilt
        by a prefill at the next turn. A JSON conversation (older /save files) loads the messages.
        A damaged file is refused whole: nothing from it is used, the session stays as it was.
        Returns one line saying what was loaded."""
        not_ours = UserError(f"{path} is not a minillama conversation (a /save file, or JSON with a messages list)")
        try:
            with open(path, "rb") as f:
                head = f.read(1)
        except (OSError, ValueError) as e:  # ValueError: a path with a NUL byte
            raise UserError(f"cannot read {path}: {getattr(e, 'strerror', None) or e}") from None
        if head == b"{":  # a JSON conversation: messages only
            data = json_conversation(path)
            if data is None:
                raise not_ours
            self._set_messages(data.get("messages"), not_ours)
            self.cache.reset()
            self.cached_ids = []
            return f"loaded {len(self.messages)} messages from {path}; the cache is rebuilt at the next turn"
        try:
            read_header(path)  # is it ours at all?
        except CacheFileError:
            raise not_ours from None
        try:
            whole = read(path)  # every checksum, the header's included, before anything is used
        except CacheFileError as e:
            raise UserError(f"{e}; nothing was loaded") from None
        extra = whole.extra
        messages = extra.get("messages") if isinstance(extra, dict) else None
        try:
            saved = load_prompt_cache(self.lm, whole, str(self.cache.spec), self.ctx, self.on_full)
        except CacheFileError as e:
            self._set_messages(messages, not_ours)
            self.cache.reset()
            self.cached_ids = []
            return f"loaded {len(self.messages)} messages from {path}; its cache is not used ({e}): prefill at the next turn"
        self._set_messages(messages, not_ours)
        self.cache, self.cached_ids = saved.cache, saved.tokens
        return (
            f"loaded {len(self.messages)} messages and their cache of {self.cache.held} tokens from {path} (no prefill)"
        )

    def _set_messages(self, messages, error: UserError) -> None:
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        ):
            raise error
        self.messages = messages

    def stats(self) -> str:
        c = self.cache
        live = c.live_bytes()
        g = self.last.generation
        lines = [
            f"kv {c.spec}: {c.held} tokens in cache (capacity {c.capacity}), {c.evicted} evicted, next position {c.position}",
            "live bytes: " + ", ".join(f"{k} {v:,}" for k, v in live.items()) + f"; total {sum(live.values()):,}",
            f"allocated bytes: {c.allocated_bytes():,}; effective bits/element "
            + (f"{c.bits_per_element():.2f}" if c.held else "- (the cache is empty)"),
            *([c.spec.auto_state(c.head_dim, c.n_layers)] if c.spec.auto else []),
            f"last step: {c.bytes.last_read:,} cache bytes read, {c.bytes.last_written:,} bytes written; "
            f"weights {weight_bytes_per_token(self.lm.model):,} bytes read a token",
            f"backend: {backend.describe()}",
            f"last turn: reused {self.last.reused_tokens} cached tokens, prefilled {self.last.prefilled_tokens} new",
        ]
        if g:
            lines.append(
                f"last turn speed: prefill {g.prefill_tokens_per_s:.1f} tok/s, decode {g.decode_tokens_per_s:.1f} tok/s "
                f"({g.generated_tokens} tokens)"
            )
        return "\n".join(lines)


HELP = """Commands:
  /help            this help
  /stats           what the cache holds and costs, and the last turn's speed
  /kv SPEC         switch the KV scheme (rebuilds the cache), e.g. /kv hadv2
  /system TEXT     set the system prompt
  /reset           forget the conversation (keeps the system prompt)
  /save FILE       save the conversation and its KV cache (one file)
  /load FILE       load a /save file: the conversation, and its cache when model and --kv match
  /exit, /quit     quit (Ctrl-D works too)
End a line with \\ to continue your message on the next line. Ctrl-C stops a reply."""


COMMANDS = ["/help", "/stats", "/kv", "/system", "/reset", "/save", "/load", "/exit", "/quit"]


def handle_command(session: ChatSession, line: str, out) -> bool:
    """Run a /command; returns False when the REPL should exit."""
    cmd, _, arg = line.strip().partition(" ")
    arg = arg.strip()
    try:
        if cmd in ("/exit", "/quit"):
            return False
        if cmd == "/help":
            out(HELP)
        elif cmd == "/stats":
            out(session.stats())
        elif cmd == "/kv" and arg:
            session.switch_kv(parse_kv(arg))
            out(
                f"kv {session.cache.spec}: {session.cache.held} tokens, {sum(session.cache.live_bytes().values()):,} bytes live, "
                f"{session.cache.allocated_bytes():,} allocated"
            )
        elif cmd == "/system" and arg:
            session.set_system(arg)
            out("system prompt set")
        elif cmd == "/reset":
            session.reset()
            out("conversation and cache cleared")
        elif cmd == "/save" and arg:
            size = session.save(arg)
            out(
                f"saved {len(session.messages)} messages and the cache of {session.cache.held} tokens to {arg} "
                f"({size:,} bytes)"
            )
        elif cmd == "/load" and arg:
            out(session.load(arg))
        else:
            import difflib

            close = difflib.get_close_matches(cmd, COMMANDS, n=1, cutoff=0.6)
            hint = f"did you mean {close[0]}? " if close and close[0] != cmd else ""
            out(f"unknown or incomplete command {shown(line.strip())}: {hint}type /help")
    except UserError as e:
        out(f"error: {e}")
    except KeyboardInterrupt:
        out("error: interrupted; the session is unchanged")
    except Exception as e:  # a failed command must never end the session the user came to keep
        out(f"error: {type(e).__name__}: {e}")
    return True


def read_message(prompt: str) -> str:
    """One user message from the terminal; a trailing backslash continues it on the next line."""
    lines = []
    while True:
        line = input(prompt if not lines else "... ")
        if line.endswith("\\"):
            lines.append(line[:-1])
            continue
        lines.append(line)
        return "\n".join(lines)


def bounded_lines(stream, limit: int, ctx: int):
    """The lines of `stream`, each read no further than `limit` characters: a longer line (a file
    with no newline, /dev/zero) cannot be a message that fits a cache of `ctx` tokens, and ends
    the session in one line before it is held in memory."""
    while line := stream.readline(limit + 1):
        if len(line) > limit and not line.endswith("\n"):
            raise UserError(f"a line of the input is longer than {limit:,} characters, more than --ctx {ctx:,} tokens")
        yield line


def history_file() -> Path | None:
    """Where typed lines are kept for the arrow keys: MINILLAMA_HISTORY (a path; "off" or empty
    for nowhere), else ~/.minillama_history (docs/chat.md)."""
    import os

    chosen = os.environ.get("MINILLAMA_HISTORY")
    if chosen is None:
        return Path.home() / ".minillama_history"
    return None if chosen.strip().lower() in ("", "off") else Path(chosen).expanduser()


def repl(session: ChatSession, interactive: bool, echo, echo_err) -> None:
    """The read-eval-print loop. Non-interactive: one stdin line per turn, replies only on stdout."""
    import sys

    if interactive:
        try:
            import readline  # noqa: F401  (line editing and history for input())

            history = history_file()
            if history is not None and history.exists():
                readline.read_history_file(history)
        except (ImportError, OSError):
            history = None
        echo_err(f"minillama chat: {session.lm.name}, kv {session.cache.spec}, ctx {session.ctx}. /help for commands.")
    info = echo if interactive else echo_err
    session.warn = lambda message: echo_err(f"warning: {message}")
    limit = session.ctx * CHARS_PER_TOKEN_BOUND
    lines = bounded_lines(sys.stdin, limit, session.ctx) if not interactive else None
    while True:
        try:
            if interactive:
                text = read_message(">>> ")
            else:
                text = next(lines, None)
                if text is None:
                    break
                text = text.rstrip("\n")
        except KeyboardInterrupt:
            echo("")  # Ctrl-C at the prompt clears the line
            continue
        except EOFError:
            echo("")
            break
        if not text.strip():
            continue
        if text.startswith("/"):
            if not handle_command(session, text, info):
                break
            continue
        try:
            for piece in session.send(text):
                echo(piece, nl=False)
            echo("")
            if session.last.interrupted:
                info("[reply stopped]")
            echo_err(session.last.line())
        except UserError as e:
            echo("")
            echo_err(f"error: {e}")
    if interactive and history is not None:
        try:
            import readline

            readline.write_history_file(history)
        except OSError:
            pass
