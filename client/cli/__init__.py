"""The ``tierstore`` command: ``main`` parses and dispatches (``main.py``); ``stat``'s
table and ``--watch`` (``statview.py``); ``tierstore demo`` (``demo.py``); the daemon
client the commands share (``support.py``). ``python -m tierstore.client.cli`` runs it."""

from .main import build_parser, main

__all__ = ["main", "build_parser"]
