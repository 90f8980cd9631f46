"""``python -m tierstore.daemon`` (what ``tierstore daemon`` runs): the node daemon, in the
foreground, with embedded defaults overridden by a TOML file, TIERSTORE_* variables
and flags."""

from __future__ import annotations

import argparse
import logging
import sys

from tierstore.config import add_config_flags, config_from_args

from .server import run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tierstore daemon", description="Run the tierstore node daemon in the "
                                "foreground. Stops cleanly on SIGTERM (drains I/O, flushes the journal).")
    add_config_flags(p)
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = config_from_args(args)
    except ValueError as e:
        logging.getLogger("tierstore.daemon").error("invalid configuration: %s", e)
        return 2
    return run(cfg)


if __name__ == "__main__":
    sys.exit(main())
