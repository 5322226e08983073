"""``streamtrain serve`` and ``streamtrain simulate``."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from streamtrain import __version__
from streamtrain.config import ENV_PREFIX, SettingsError, load_settings
from streamtrain.runtime.allocator import malloc_in_use

log = logging.getLogger("streamtrain")


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    logging.getLogger("kafka").setLevel(logging.WARNING)


def _port_given_to_the_process(args: argparse.Namespace) -> bool:
    """``--port`` or ``STREAMTRAIN_HTTP_PORT``: a port for this process alone, not one per host."""
    return args.port is not None or any(name.upper() == f"{ENV_PREFIX}HTTP_PORT" for name in os.environ)


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _http_server(config: Any) -> Any:
    """A ``uvicorn.Server`` that stops on SIGINT/SIGTERM like uvicorn's own, but does not
    re-raise the signal once it has shut down.

    uvicorn >= 0.29 re-raises the signal it caught after its graceful shutdown, so a process
    with the default handler ends *by* SIGTERM (status -15, 143 to Kubernetes) although it
    stopped cleanly. The service's exit status says how the stop went instead: 0 once the
    final checkpoint is written, 1 when it is not (``_serve``).
    """
    import uvicorn

    class ServiceServer(uvicorn.Server):
        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            # A second SIGINT forces the exit (uvicorn's "Ctrl-C again"). A first SIGINT after a
            # SIGTERM is the same stop asked twice (Ctrl-C reaches the terminal's whole process
            # group, and scripts/run-local.sh passes the stop on as SIGTERM): the graceful
            # shutdown goes on instead of being cut off mid-way.
            if self.should_exit and sig == signal.SIGINT and signal.SIGINT not in self._captured_signals:
                self._captured_signals.append(sig)
                return
            super().handle_exit(sig, frame)

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in STOP_SIGNALS}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    return ServiceServer(config)


def _serve(args: argparse.Namespace) -> int:
    overrides: dict[str, Any] = {}
    if args.host is not None:
        overrides["http_host"] = args.host
    if args.port is not None:
        overrides["http_port"] = args.port
    try:
        settings = load_settings(args.config, **overrides)
        _setup_logging(settings.log_level)
        # heavy imports (torch) after the settings check
        from streamtrain.distributed.launch import DistContext
        from streamtrain.runtime.service import Service

        ctx = DistContext.from_env()  # torchrun's WORLD_SIZE, RANK, ...; unset: one process
        port = ctx.http_port(settings.http_port, explicit=_port_given_to_the_process(args))
        service = Service(settings, ctx)
    except SettingsError as err:
        print(f"streamtrain: {err}", file=sys.stderr)
        return 2
    except ValueError as err:  # the DP refuse-list, a bad launch environment: one line naming the fix
        print(f"streamtrain: {err}", file=sys.stderr)
        return 2

    import uvicorn

    from streamtrain.serve.app import create_app

    public = settings.public_dict()
    log.info("settings: %s", {k: public[k] for k in sorted(public)})
    if (allocator := malloc_in_use()) == "glibc":  # after the refusals above: those stay one line
        log.warning(
            "malloc: glibc; RSS will settle well above what the service uses "
            '(run with LD_PRELOAD="$(deploy/jemalloc.sh)", as the image does; docs/operations.md, Memory)'
        )
    else:
        log.info("malloc: %s", allocator)
    if ctx.distributed:
        log.info("rank %d of %d (local rank %d), HTTP port %d", ctx.rank, ctx.world_size, ctx.local_rank, port)
    from streamtrain.distributed.collectives import CollectiveFailure, exit_after_collective_failure
    from streamtrain.distributed.wire import SettingsMismatch
    from streamtrain.runtime.service import IncompatibleCheckpoint

    server: uvicorn.Server | None = None

    def stop_http() -> None:
        """The ranks agreed to stop and cut the final checkpoint: this rank's HTTP server stops
        too, also when it was not the one signalled."""
        if server is not None:
            server.should_exit = True

    service.on_agreed_stop = stop_http
    try:
        service.start()  # restores the newest checkpoint (and the DP admission record) before any thread starts
    except (IncompatibleCheckpoint, SettingsMismatch, ValueError) as err:  # incl. a DP record it must not resume from
        print(f"streamtrain: {err}", file=sys.stderr)
        service.stop(final_checkpoint=False)
        return 2
    except CollectiveFailure as err:  # a peer died or hung while the ranks restored together
        exit_after_collective_failure(err)
    config = uvicorn.Config(
        create_app(service),
        host=settings.http_host,
        port=port,
        log_level=settings.log_level.lower(),
        access_log=False,
        timeout_graceful_shutdown=5,
    )
    server = _http_server(config)
    if service.loop is not None and service.loop.finished.is_set():
        server.should_exit = True  # the stop was agreed before the server existed
    # Not before: a process still starting (a rank waiting for the others) ends at once on a
    # signal. From here on SIGINT/SIGTERM stop the server (ours for the moment before it
    # runs and after, the server's while it runs), whose shutdown writes the final checkpoint.
    for sig in STOP_SIGNALS:
        signal.signal(sig, lambda signum, frame: setattr(server, "should_exit", True))
    try:
        server.run()  # returns on SIGINT/SIGTERM, or once the ranks agreed to stop
    finally:
        service.stop(final_checkpoint=True)  # done in the server's shutdown already, unless it was skipped
    if service.final_checkpoint_error is not None:
        last = service.last_checkpoint
        resumes = f"a restart resumes from {last.name}" if last is not None else "this process wrote no checkpoint"
        print(f"streamtrain: stopped without a final checkpoint ({resumes}): {service.final_checkpoint_error}",
              file=sys.stderr)  # fmt: skip
        return leave(1)
    log.info("stopped after the final checkpoint")
    return leave(0)


def leave(status: int) -> int:
    """``status``, or, while a background torch.compile still runs, this process ended at once
    with it: the interpreter's teardown under a compile thread in C++ aborts the process
    ("terminate called without an active exception", status -6) after the clean stop."""
    from streamtrain.model.compiled import compiling

    if not compiling():
        return status
    log.info("a torch.compile is still running: leaving without the interpreter's teardown")
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


EXPORT_FORMATS = ("triton-pytorch", "triton-onnx", "onnx", "exported-program")


def _export(args: argparse.Namespace) -> int:
    import os

    from streamtrain.tools.export import (
        ExportError,
        bundle_from_checkpoint,
        describe,
        export_onnx,
        export_program,
        fetch_bundle,
        write_triton_repository,
    )

    try:
        if args.url is not None:
            token = os.environ.get(f"{ENV_PREFIX}ADMIN_TOKEN", "")
            if args.admin_token_file is not None:
                token = Path(args.admin_token_file).read_text(encoding="utf-8").strip()
            if not token:
                raise ExportError(
                    f"--url needs the service's admin token: set {ENV_PREFIX}ADMIN_TOKEN or pass --admin-token-file"
                )
            bundle = fetch_bundle(args.url, args.version or "serving", token)
        else:
            settings = load_settings(args.config)
            bundle = bundle_from_checkpoint(args.checkpoint_dir or settings.checkpoint_dir, settings)
            if args.version not in (None, "serving", str(bundle.version)):
                raise ExportError(
                    f"the newest checkpoint holds version {bundle.version}, not {args.version}; "
                    "export other kept versions from the running service (--url)"
                )
        out = Path(args.out)
        if args.format == "triton-pytorch":
            written = write_triton_repository(bundle, out, "pytorch")
        elif args.format == "triton-onnx":
            written = write_triton_repository(bundle, out, "onnxruntime")
        elif args.format == "onnx":
            written = export_onnx(bundle, out)
        else:
            written = export_program(bundle, out)
    except (ExportError, SettingsError, OSError) as err:
        print(f"streamtrain export: {err}", file=sys.stderr)
        return 2
    print(f"streamtrain export: wrote {args.format} of {describe(bundle)} to {written}")
    return 0


def _add_export(commands: Any) -> None:
    export = commands.add_parser(
        "export",
        help="write a published model as a Triton model repository, an ONNX file or an ExportedProgram",
        description=(
            "Export one published model version, from a running service (--url; its admin route, "
            f"token from {ENV_PREFIX}ADMIN_TOKEN or --admin-token-file) or from the newest checkpoint "
            "(--checkpoint-dir). Formats: triton-pytorch (OUT/streamtrain/config.pbtxt + "
            "OUT/streamtrain/<version>/model.pt, TorchScript), triton-onnx (the same with model.onnx), "
            "onnx (one file OUT), exported-program (torch.export, one file OUT). Every format takes "
            "values [batch, length, channels] float32 and lengths [batch] int64 and answers next, "
            "anomaly_score (and probs), normalization included."
        ),
    )
    source = export.add_mutually_exclusive_group()
    source.add_argument("--url", help="a running service, e.g. http://localhost:8000")
    source.add_argument("--checkpoint-dir", metavar="DIR", help="a checkpoint directory (default: CHECKPOINT_DIR)")
    export.add_argument("--version", help="a kept version number or 'serving' (default: serving)")
    export.add_argument("--admin-token-file", metavar="FILE", help="file holding the admin token (with --url)")
    export.add_argument("--config", metavar="FILE", help="TOML settings (with a DP checkpoint: the public norm)")
    export.add_argument("--format", choices=EXPORT_FORMATS, default="triton-onnx", help="default: triton-onnx")
    export.add_argument("--out", required=True, help="repository directory (triton-*) or file (onnx, exported-program)")
    export.set_defaults(func=_export)


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

    from streamtrain.tools.simulate import add_cli as add_simulate

    add_simulate(commands)
    _add_export(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
