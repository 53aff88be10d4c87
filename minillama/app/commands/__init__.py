"""The ``minillama`` commands, one module each; ``app/cli.py`` registers them.

Each command parses its options, calls the library, and prints. Errors raised as
``UserError`` become one ``error:`` line (see ``app/cli.py: Main``).
"""
