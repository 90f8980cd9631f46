"""``python -m tierstore.daemon`` (what ``tierstore daemon`` runs): the node daemon, in the
foreground, with embedded defaults overridden by a TOML file, TIERSTORE_* variables
and flags (in that order; ``tierstore config`` shows the result and where each value
came from)."""

from __future__ import annotations

import logging
import sys

from tierstore.config import ConfigError, daemon_parser, describe_value, sourced_config_from_args

log = logging.getLogger("tierstore.daemon")


def main(argv: list[str] | None = None) -> int:
    from .stopsignals import StopDuringStart, stop_during_start

    stop_during_start()
    try:
        return _main(argv)
    except StopDuringStart as e:
        log.error("%s", e)
        return e.status


def _main(argv: list[str] | None) -> int:
    args = daemon_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg, sources = sourced_config_from_args(args)
    except ConfigError as e:
        log.error("invalid configuration: %s; fix or unset it (tierstore config shows every setting and its "
                  "source)", e)
        return 2
    logging.getLogger().setLevel(cfg.daemon.log_level)
    given = {k: v for k, v in sources.items() if v != "default"}
    log.info("settings: %s", "; ".join(f"{k}={describe_value(k, cfg.get(k))} ({v})" for k, v in given.items())
             if given else "all defaults")
    from tierstore.errors import TierstoreError
    from tierstore.preflight import check_daemon_start

    try:  # the checks that can refuse a start, before the heavy imports (NumPy, the store)
        check_daemon_start(cfg)
    except (TierstoreError, OSError) as e:
        log.error("cannot start: %s", e)
        return 1
    from .server import run

    return run(cfg)


if __name__ == "__main__":
    sys.exit(main())
