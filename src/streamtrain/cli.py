"""``streamtrain serve`` and ``streamtrain simulate``."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import Any

from streamtrain import __version__
from streamtrain.config import ENV_PREFIX, SettingsError, load_settings

log = logging.getLogger("streamtrain")


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    logging.getLogger("kafka").setLevel(logging.WARNING)


def _serve(args: argparse.Namespace) -> int:
    overrides: dict[str, Any] = {}
    if args.host is not None:
        overrides["http_host"] = args.host
    if args.port is not None:
        overrides["http_port"] = args.port
    try:
        settings = load_settings(args.config, **overrides)
        _setup_logging(settings.log_level)
        from streamtrain.service import Service  # heavy imports (torch) after the settings check

        service = Service(settings)
    except SettingsError as err:
        print(f"streamtrain: {err}", file=sys.stderr)
        return 2
    except ValueError as err:  # e.g. the DP refuse-list: one line naming the setting and the fix
        print(f"streamtrain: {err}", file=sys.stderr)
        return 2

    import uvicorn

    from streamtrain.serve.app import create_app

    public = settings.public_dict()
    log.info("settings: %s", {k: public[k] for k in sorted(public)})
    try:
        service.start()
    except ValueError as err:  # a checkpoint or DP admission record it must not resume from
        print(f"streamtrain: {err}", file=sys.stderr)
        service.stop(final_checkpoint=False)
        return 2
    config = uvicorn.Config(
        create_app(service),
        host=settings.http_host,
        port=settings.http_port,
        log_level=settings.log_level.lower(),
        access_log=False,
        timeout_graceful_shutdown=5,
    )
    server = uvicorn.Server(config)
    try:
        server.run()  # returns on SIGINT/SIGTERM
    finally:
        log.info("shutting down: final checkpoint")
        service.stop(final_checkpoint=True)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="streamtrain",
        description="Continuous PyTorch training from a Kafka stream of sensor events.",
    )
    parser.add_argument("--version", action="version", version=f"streamtrain {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = commands.add_parser(
        "serve",
        help="run ingest, window, continuous training and the HTTP API",
        description=(
            "Run the long-lived service. Every setting has a default for a local broker on "
            f"localhost:9092, can be set in a TOML file (--config) and is overridden by {ENV_PREFIX}<NAME> "
            "environment variables (e.g. STREAMTRAIN_TOPIC, STREAMTRAIN_WINDOW_CAPACITY)."
        ),
    )
    serve.add_argument("--config", metavar="FILE", help="TOML file with settings (keys: lower-case setting names)")
    serve.add_argument("--host", help="HTTP bind address (default from HTTP_HOST, 0.0.0.0)")
    serve.add_argument("--port", type=int, help="HTTP port (default from HTTP_PORT, 8000)")
    serve.set_defaults(func=_serve)

    from streamtrain.simulate import add_cli as add_simulate

    add_simulate(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
