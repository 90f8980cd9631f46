"""Helpers for the CLI's daemon-backed subcommands."""

from __future__ import annotations


def connect(socket: str | None, namespace: str):
    from .client import Client

    return Client.connect(socket=socket, namespace=namespace)
