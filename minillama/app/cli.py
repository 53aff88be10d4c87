"""The ``minillama`` command line: a thin click layer over the library API.

Every command's work is a function in the package; this file only parses options,
prints, and turns errors into one clear line (a traceback only with --debug).
"""

from __future__ import annotations

import os
import signal
import sys
import threading

import click

from minillama.app.commands import bench, chat, fetch, generate, kv, needle, ppl
from minillama.errors import UsageError, UserError


def _terminated(signum, frame):
    """SIGTERM unwinds like Ctrl-C does, so every ``finally`` runs and no temp file is left behind."""
    raise SystemExit(128 + signum)


class Main(click.Group):
    """Turns any error into one line on stderr and exit 1 (usage errors: exit 2), unless --debug is given."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        """click prints a usage error as three lines (Usage:, Try, Error:); here it is one ``error:``
        line that names the command's --help, with click's exit code (2)."""
        previous = None  # the handler before this run's, put back when it ends (runs in a process: tests)
        if threading.current_thread() is threading.main_thread():
            previous = signal.signal(signal.SIGTERM, _terminated)
        try:
            result = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.ClickException as e:
            command = " ".join(
                filter(None, [e.ctx.command_path if getattr(e, "ctx", None) else prog_name or "minillama"])
            )
            click.echo(f"error: {e.format_message()} (see {command} --help)", err=True)
            sys.exit(e.exit_code)
        except click.exceptions.Abort:
            click.echo("interrupted", err=True)
            sys.exit(130)
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
        if not standalone_mode:
            return result
        sys.exit(result if isinstance(result, int) else 0)

    def invoke(self, ctx):
        try:
            result = super().invoke(ctx)
            if (ctx.obj or {}).get("debug"):
                from minillama.native import backend

                click.echo(f"debug: backend {backend.describe()}", err=True)
                for reason in backend.fallbacks():
                    click.echo(f"debug: the reference ran instead of a kernel: {reason}", err=True)
            return result
        except (click.exceptions.Exit, click.exceptions.Abort, click.ClickException):
            raise
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(130)
        except BrokenPipeError:  # the reader of stdout left (`| head`): stop quietly, as other tools do
            # stdout to /dev/null first, so that Python's own flush at exit does not fail again
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            sys.exit(141)  # 128 + SIGPIPE
        except Exception as e:
            if ctx.params.get("debug") or (ctx.obj or {}).get("debug"):
                raise
            click.echo(f"error: {error_line(e)}", err=True)
            sys.exit(2 if isinstance(e, UsageError) else 1)


def error_line(e: Exception) -> str:
    """One line for an error: a UserError's message; an allocator's failure (whose message can be a
    hundred-line C++ backtrace) as out of memory with what to do; anything else by its type and
    first line, cut."""
    first = (str(e).strip().splitlines() or [""])[0]
    first = first if len(first) <= 200 else first[:200] + "..."
    if isinstance(e, UserError):
        return str(e)
    if isinstance(e, MemoryError) or any(s in first for s in ("can't allocate memory", "out of memory")):
        return (
            f"out of memory ({first or type(e).__name__}): lower --ctx, pick a smaller --kv, use --dtype bfloat16 "
            "or a smaller model"
        )
    return f"{type(e).__name__}: {first} (rerun with --debug for a traceback)"


@click.group(cls=Main, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="minillama", prog_name="minillama", message="%(prog)s %(version)s")
@click.option("--debug", is_flag=True, help="Show full tracebacks on errors.")
@click.pass_context
def cli(ctx, debug):
    """minillama: a small Llama engine that owns its KV cache.

    \b
    Examples:
      minillama fetch                      # install the offline default model
      minillama generate "Once upon a time" --max-tokens 40
      minillama chat --kv hadv2            # chat with a 4-bit-K / 2-bit-V cache
      minillama ppl --dataset hamlet --kv fp16 --kv hadv2   # cached-path perplexity, KLD
      minillama needle --kv fp16 --kv hadv2                 # long-context retrieval
      minillama kv --list                  # cache codecs and presets
    """
    ctx.obj = {"debug": debug}


def main():
    cli(prog_name="minillama")


# The one place commands are registered; each command module imports only the library.
for command in (fetch.fetch, generate.generate, chat.chat, kv.kv, ppl.ppl, needle.needle, bench.bench):
    cli.add_command(command)
