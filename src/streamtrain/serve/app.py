"""FastAPI application factory: one router per concern, the service injected, no globals.

Inference runs off the event loop on a few worker threads that merge concurrent requests
into shared forwards (serve/batcher.py); requests beyond the workers and their queue get
503 at once instead of piling up, so ``/healthz`` stays fast under load.
"""

from __future__ import annotations

import functools
import hmac
import math
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

import anyio
import numpy as np
import torch
from fastapi import APIRouter, Depends, FastAPI, HTTPException, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from streamtrain import __version__
from streamtrain.events import REASONS, EventError, parse_values
from streamtrain.metrics import INGEST_RESTART_REASONS
from streamtrain.model.inference import CompiledInference, PredictionArrays, predict_arrays
from streamtrain.model.network import build_model
from streamtrain.runtime.service import Service
from streamtrain.runtime.topology import RollbackNotTaken
from streamtrain.serve import oip
from streamtrain.serve.batcher import Overloaded, PredictBatcher
from streamtrain.serve.schemas import (
    CheckpointChainReport,
    CheckpointResult,
    ErrorOut,
    Health,
    ModelReport,
    PredictionOut,
    PredictRequest,
    PredictResponse,
    Quantiles,
    Readiness,
    ReadingsCompactionReport,
    RollbackRequest,
    RollbackResult,
    WindowReport,
)
from streamtrain.tools.export import encode_bundle
from streamtrain.training.registry import UnknownVersion


def get_service(request: Request) -> Service:
    return request.app.state.service


ServiceDep = Annotated[Service, Depends(get_service)]


# ---------------------------------------------------------------------- health
health = APIRouter(tags=["health"])


@health.get("/healthz", response_model=Health)
def healthz() -> Health:
    """200 while the process runs."""
    return Health(status="ok")


@health.get("/readyz", response_model=Readiness, responses={503: {"model": Readiness}})
def readyz(service: ServiceDep) -> Any:
    """200 when the consumer is connected and a model is published, else 503 with reasons."""
    ready, reasons = service.readiness()
    if ready:
        return Readiness(status="ok", reasons=reasons)
    return JSONResponse(status_code=503, content={"status": "not_ready", "reasons": reasons})


# ---------------------------------------------------------------------- window
window_router = APIRouter(tags=["window"])


def window_report(service: ServiceDep) -> WindowReport:
    """Window statistics and the ledger of the Kafka messages the window covers (kept across restarts);
    in DP mode operator plane only (admin token)."""
    stats = service.window.stats()
    chain = service.window_chain.report()
    return WindowReport(
        size=stats.size,
        capacity=stats.capacity,
        seen_total=stats.seen_total,
        accepted_total=stats.accepted_total,
        rejected_total={reason: int(stats.rejected_total.get(reason, 0)) for reason in REASONS},
        held_out_total=stats.held_out_total,
        evicted_total=stats.evicted_total,
        half_life_s=None if math.isinf(stats.half_life_s) else stats.half_life_s,
        tokens=stats.tokens,
        sensors=stats.sensors,
        age_s=None if stats.age_s is None else Quantiles.model_validate(vars(stats.age_s)),
        length=None if stats.length is None else Quantiles.model_validate(vars(stats.length)),
        next_offsets={str(p): o for p, o in sorted(service.window.next_offsets.items())},
        last_record_age_s=service.ingest.last_record_age_s,
        ingest_restarts_total={
            reason: int(service.ingest.restarts.get(reason, 0)) for reason in INGEST_RESTART_REASONS
        },
        dead_letters_pending=service.ingest.dead_letters.pending,
        partitions=sorted(service.ingest.assigned),
        checkpoints=CheckpointChainReport.model_validate(vars(chain)),
        readings_compaction=ReadingsCompactionReport.model_validate(vars(service.window.compactions)),
    )


window_router.add_api_route("/v1/window", window_report, methods=["GET"], response_model=WindowReport)


# ---------------------------------------------------------------------- model
model_router = APIRouter(tags=["model"])


@model_router.get("/v1/model", response_model=ModelReport)
def model_report(service: ServiceDep) -> ModelReport:
    """The serving model's version, training progress and, in DP mode, the privacy spent."""
    published = service.published
    trainer = service.trainer
    report = trainer.report()
    if not report.public_progress:  # DP: only the public clock, the published version and ε
        return ModelReport(
            quality=None,
            versions=trainer.registry.versions(),
            version=None if published is None else published.version,
            step=trainer.step if published is None else published.step,
            tokens_trained=None,
            loss=None,
            published_at=None if published is None else published.published_at,
            dp=report.dp,
            training=report.training,
            world_size=service.ctx.world_size,
            rank=service.ctx.rank,
        )
    return ModelReport(
        forecaster=report.forecaster,
        replays_per_event=report.replays_per_event,
        quality=report.quality,
        versions=trainer.registry.versions(),
        version=None if published is None else published.version,
        step=trainer.step if published is None else published.step,
        tokens_trained=trainer.tokens_trained if published is None else published.tokens_trained,
        loss=None if published is None or published.loss is None else published.loss,
        published_at=None if published is None else published.published_at,
        dp=None,
        training=report.training,
        world_size=service.ctx.world_size,
        rank=service.ctx.rank,
    )


def _unprocessable(message: str) -> HTTPException:
    return HTTPException(status_code=422, detail=message)


@model_router.post(
    "/v1/predict",
    response_model=PredictResponse,
    response_model_exclude_none=True,
    responses={422: {"model": ErrorOut}, 503: {"model": ErrorOut}},
)
async def predict(body: PredictRequest, request: Request, service: ServiceDep) -> PredictResponse:
    """No-shuffle inference: one prediction per instance, in the order given.

    An instance's answer never depends on the order or company of the others.
    """
    settings = service.settings
    count = len(body.instances)
    if not 1 <= count <= settings.max_predict_batch:
        raise _unprocessable(f"instances: expected 1..{settings.max_predict_batch} instances, got {count}")
    arrays = []
    for i, instance in enumerate(body.instances):
        try:
            arrays.append(parse_values(instance.values, settings.channels, settings.max_len))
        except EventError as err:
            raise _unprocessable(f"instances[{i}].values: {err.reason}: {err.detail}") from None
    published = service.published  # one model version for the whole request
    if published is None:
        raise HTTPException(status_code=503, detail="no model published yet: the window is still filling")
    batcher: PredictBatcher = request.app.state.predict_batcher
    try:
        predictions: PredictionArrays = await batcher.submit(published, arrays)
    except Overloaded as err:
        raise HTTPException(status_code=503, detail=f"overloaded: {err}; retry later") from None
    overflowed = np.flatnonzero(~predictions.finite_rows())
    if overflowed.size:
        raise _unprocessable(
            f"instances[{int(overflowed[0])}].values: non_finite: the forecast overflows for these readings; "
            "they lie far outside the range the model works in"
        )
    return PredictResponse(
        model_version=published.version,
        model_age_s=oip.model_age_s(published),
        predictions=[
            PredictionOut(next=p.next, anomaly_score=p.anomaly_score, probs=p.probs)
            for p in predictions.to_predictions()
        ],
    )


# ---------------------------------------------------------------------- metrics
metrics_router = APIRouter(tags=["metrics"])


_EXPOSITION = "text/plain; version=0.0.4; charset=utf-8"


@metrics_router.get("/metrics", response_class=Response)
def metrics(service: ServiceDep) -> Response:
    """Prometheus text exposition (a plain route: no redirect to /metrics/); DP mode: the public plane only."""
    return Response(service.metrics.exposition(public_only=service.settings.dp == "on"), media_type=_EXPOSITION)


# ---------------------------------------------------------------------- admin
admin = APIRouter(tags=["admin"], prefix="/v1/admin")


def require_admin(request: Request) -> None:
    """Bearer token, compared in constant time; 401 without credentials, 403 with wrong ones."""
    expected: str = request.app.state.admin_token
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token:
        raise HTTPException(status_code=401, detail="admin token required", headers={"WWW-Authenticate": "Bearer"})
    if not hmac.compare_digest(token.strip().encode(), expected.encode()):
        raise HTTPException(status_code=403, detail="admin token not accepted")


@admin.post(
    "/checkpoint",
    response_model=CheckpointResult,
    dependencies=[Depends(require_admin)],
    responses={401: {"model": ErrorOut}, 403: {"model": ErrorOut}, 503: {"model": ErrorOut}},
)
def admin_checkpoint(service: ServiceDep) -> CheckpointResult:
    """Write a checkpoint now."""
    path = service.checkpoint()
    if path is None:
        raise HTTPException(status_code=503, detail=f"checkpoint failed: {service.checkpoint_error}")
    return CheckpointResult(path=path.name, step=service.trainer.step)


_BUNDLE_RESPONSE = {
    "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
    "description": "safetensors bundle: the model's tensors, its normalization and a JSON description",
}


@admin.get(
    "/models/{version}",
    dependencies=[Depends(require_admin)],
    response_class=Response,
    responses={200: _BUNDLE_RESPONSE, 401: {"model": ErrorOut}, 403: {"model": ErrorOut}, 404: {"model": ErrorOut}},
)
def admin_model(version: str, service: ServiceDep) -> Response:
    """A kept version (or ``serving``) as the bundle ``streamtrain export --url`` reads."""
    registry = service.trainer.registry
    published = None
    if version == "serving":
        published = registry.serving
    elif version.isascii() and version.isdigit():
        try:
            published = registry.get(int(version))
        except UnknownVersion:
            published = None
    if published is None:
        kept = ", ".join(map(str, registry.versions())) or "none yet"
        raise HTTPException(status_code=404, detail=f"no kept model version {version!r} (kept: {kept})")
    return Response(
        encode_bundle(published),
        media_type="application/octet-stream",
        headers={"Content-Disposition": f'attachment; filename="streamtrain-v{published.version}.safetensors"'},
    )


@admin.post(
    "/rollback",
    response_model=RollbackResult,
    dependencies=[Depends(require_admin)],
    responses={
        401: {"model": ErrorOut},
        403: {"model": ErrorOut},
        404: {"model": ErrorOut},
        422: {"model": ErrorOut},
        503: {"model": ErrorOut},
    },
)
def admin_rollback(body: RollbackRequest, service: ServiceDep) -> RollbackResult:
    """Make a kept earlier version serve again; training continues from its weights.

    Scaled out, every rank rolls back at the same step; the answer comes once they have.
    """
    try:
        version, previous = service.rollback(body.version, reason="asked by an admin")
    except UnknownVersion:
        kept = service.trainer.registry.versions()
        raise HTTPException(
            status_code=404, detail=f"version {body.version} is not kept; kept versions: {kept}"
        ) from None
    except RollbackNotTaken as err:
        raise HTTPException(status_code=503, detail=str(err)) from None
    return RollbackResult(version=version, previous=previous)


@admin.get(
    "/metrics",
    response_class=Response,
    dependencies=[Depends(require_admin)],
    responses={401: {"model": ErrorOut}, 403: {"model": ErrorOut}},
)
def admin_metrics(service: ServiceDep) -> Response:
    """Every metric, the operator plane included (in DP mode: outside the guarantee)."""
    return Response(service.metrics.exposition(), media_type=_EXPOSITION)


@admin.get(
    "/dp",
    dependencies=[Depends(require_admin)],
    responses={401: {"model": ErrorOut}, 403: {"model": ErrorOut}, 404: {"model": ErrorOut}},
)
def admin_dp(service: ServiceDep) -> dict[str, Any]:
    """DP operator plane: batch sizes, tokens, step times, window and record state (outside the guarantee)."""
    report = service.trainer.operator_report()
    if report is None:
        raise HTTPException(status_code=404, detail="DP is off (STREAMTRAIN_DP=off)")
    return report


# ---------------------------------------------------------------------- middleware
class BodySizeLimit:
    """413 for request bodies over ``limit`` bytes, declared or streamed."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await self._reject(send, scope.get("path", ""))
            return
        received = 0
        exceeded = started = False

        async def limited_receive() -> Message:
            nonlocal received, exceeded
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    exceeded = True
                    raise _BodyTooLarge
            return message

        async def guarded_send(message: Message) -> None:
            # FastAPI turns any error while reading the body into its own 400: when the
            # limit was hit, that answer is dropped and the 413 below goes out instead.
            nonlocal started
            if exceeded and not started:
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except _BodyTooLarge:
            pass
        if exceeded and not started:
            await self._reject(send, scope.get("path", ""))

    async def _reject(self, send: Send, path: str = "") -> None:
        # The Open Inference Protocol's routes answer errors as {"error": ...}.
        key = b"error" if path.startswith("/v2/") else b"detail"
        body = b'{"' + key + b'":"request body too large"}'
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": body})


_UNPARSABLE_BODY = "There was an error parsing the body"  # FastAPI's 400 for an undecodable body


class _BodyTooLarge(Exception):
    pass


def _predict_metrics(app: FastAPI, service: Service) -> None:
    @app.middleware("http")
    async def count_predictions(request: Request, call_next: Any) -> Response:
        path = request.url.path
        if path != "/v1/predict" and not (path.startswith("/v2/models/") and path.endswith("/infer")):
            return await call_next(request)
        started = time.perf_counter()
        response = await call_next(request)
        service.metrics.predict_requests.labels(str(response.status_code)).inc()
        service.metrics.predict_latency.observe(time.perf_counter() - started)
        return response


@asynccontextmanager
async def _stop_service_on_shutdown(app: FastAPI) -> AsyncIterator[None]:
    """The final checkpoint runs in the server's graceful shutdown, before ``run()`` returns;
    the CLI then exits 0, or 1 when it was not written (``service.final_checkpoint_error``)."""
    yield
    app.state.predict_batcher.close()
    await anyio.to_thread.run_sync(app.state.service.stop)


def create_app(service: Service) -> FastAPI:
    """The HTTP API of docs/contract.md, section 2, over ``service``."""
    settings = service.settings
    app = FastAPI(
        title="streamtrain",
        version=__version__,
        description="Continuous training from a Kafka stream of sensor events.",
        lifespan=_stop_service_on_shutdown,
    )
    app.state.service = service
    # The predict forward, compiled on a background thread (eager until then): COMPILE.
    template = build_model(settings).to(torch.device(settings.device))
    app.state.inference = CompiledInference(template, enabled=settings.compile == "on")
    app.state.predict_batcher = PredictBatcher(
        functools.partial(predict_arrays, forward=app.state.inference),
        settings.token_budget,
        workers=settings.predict_concurrency,
        admit=settings.predict_concurrency + settings.predict_queue,
        max_instances=settings.predict_merge_instances,
    )
    app.include_router(health)
    admin_on = settings.admin_token is not None and bool(settings.admin_token.get_secret_value())
    if settings.dp != "on":
        app.include_router(window_router)
    elif admin_on:  # DP mode: window statistics are operator plane, behind the admin token
        app.add_api_route("/v1/window", window_report, methods=["GET"], response_model=WindowReport, tags=["admin"],
                          dependencies=[Depends(require_admin)],
                          responses={401: {"model": ErrorOut}, 403: {"model": ErrorOut}})  # fmt: skip
    app.include_router(model_router)
    app.include_router(metrics_router)
    app.include_router(oip.router)
    if admin_on and settings.admin_token is not None:
        app.state.admin_token = settings.admin_token.get_secret_value()
        app.include_router(admin)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        """422 naming where and what, never 500, never echoing huge inputs back."""
        problems = []
        for error in exc.errors()[:10]:
            where = ".".join(str(p) for p in error.get("loc", ()) if p != "body")
            problems.append(f"{where or 'body'}: {error.get('msg', 'invalid')}")
        return JSONResponse(status_code=422, content={"detail": "; ".join(problems)})

    @app.exception_handler(StarletteHTTPException)
    async def unreadable_body(request: Request, exc: StarletteHTTPException) -> Response:
        """A body FastAPI cannot even decode (not UTF-8) is invalid input too: 422, as the contract says."""
        if exc.status_code == 400 and exc.detail == _UNPARSABLE_BODY:
            return JSONResponse(status_code=422, content={"detail": "body: not UTF-8 JSON"})
        return await http_exception_handler(request, exc)

    _predict_metrics(app, service)
    app.add_middleware(BodySizeLimit, limit=settings.max_request_bytes)
    return app
