"""``python -m tierstore.daemon`` (what ``tierstore daemon`` runs): the node daemon, in the
foreground, with embedded defaults overridden by a TOML file, TIERSTORE_* variables
and flags (in that order; ``tierstore config`` shows the result and where each value
came from)."""

from __future__ import annotations

import logging
import os
import sys

from tierstore._version import __version__
from tierstore.config import ArgumentParser, ConfigError, add_config_flags, describe_value, sourced_config_from_args

log = logging.getLogger("tierstore.daemon")


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="tierstore daemon", description="Run the tierstore node daemon in the foreground. "
                       "Stops cleanly on SIGTERM (drains I/O, flushes the journal). Precedence of settings: "
                       "flags > TIERSTORE_* variables > TOML file > defaults.")
    p.add_argument("--version", action="version", version=f"tierstore {__version__}")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                   help="daemon log level (default: INFO)")
    add_config_flags(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg, sources = sourced_config_from_args(args)
    except ConfigError as e:
        log.error("invalid configuration: %s; fix or unset it (tierstore config shows every setting and its "
                  "source)", e)
        return 2
    given = {k: v for k, v in sources.items() if v != "default"}
    log.info("settings: %s", "; ".join(f"{k}={describe_value(k, getattr(cfg, k))} ({v})" for k, v in given.items())
             if given else "all defaults")
    from tierstore.errors import TierstoreError
    from tierstore.preflight import check_dir, check_start

    try:  # the checks that can refuse a start, before the heavy imports (NumPy, the store)
        resolved = cfg.resolved()
        check_dir(os.path.dirname(resolved.socket) or ".", mode=0o750, what="socket directory", flag="--socket")
        check_start(resolved)
    except (TierstoreError, OSError) as e:
        log.error("cannot start: %s", e)
        return 1
    from .server import run

    return run(cfg)


if __name__ == "__main__":
    sys.exit(main())
