"""The application wing: the ``minillama`` command line and the chat REPL.

``cli`` builds the click group and registers the commands in ``commands/``, each a thin
layer over the library; ``chat`` and ``chat_template`` are the conversation and its
rendering. Nothing below this wing imports from it.
"""
