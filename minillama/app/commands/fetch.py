"""``minillama fetch``: install the offline default model."""

from __future__ import annotations

import click


@click.command()
@click.option("--force", is_flag=True, help="Rebuild the folder even if it exists.")
def fetch(force):
    """Install the offline default model (SmolLM2-135M-Instruct) into weights/.

    \b
    Example:
      minillama fetch --force
    """
    from minillama.app.default_model import fetch_default

    click.echo(str(fetch_default(force=force)))
