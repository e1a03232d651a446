"""The endpoint's HTTP application (Starlette on uvicorn; why this and not a serving engine: docs/BENCHMARKS.md
"Serving").

    POST /predict        photos: a raw image/png or image/jpeg body, or multipart/form-data with image files;
                         ?top_k=N. Answers {"model", "version", "predictions": [{"file", "top_k": [...]}]}
    POST /invocations    today's JSON contract {"inputs": uint8 images [batch, 32, 32, 3]}; answers MLflow's
                         {"predictions": {"class_ids", "class_names", "probabilities"}} plus "version"
    GET  /               the try-it page          GET /model-card   the served version's model card
    GET  /version        what is served, what was refused, the last switches
    GET  /health/live    200 while the process runs
    GET  /health/ready   200 with a verified version, else 503 (also /ping, as `mlflow models serve` has it)

Every answer from a model names its version: the body and the X-Model-Version header. A 400 is one line
naming the problem; a full queue or no verified version yet is a 503 with Retry-After.
"""

from __future__ import annotations

import contextlib
import gc
from importlib import resources

import anyio.to_thread
import numpy as np
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from cifar.endpoint.batcher import Batcher, Overloaded
from cifar.endpoint.follower import ChampionFollower, EventHook
from cifar.endpoint.requests import BadRequest, Images, read_photos, read_tensor
from cifar.endpoint.settings import ServeSettings
from cifar.endpoint.versions import ServedVersion

VERSION_HEADER = "X-Model-Version"


class Unavailable(RuntimeError):
    """No verified version to answer with yet."""


def create_app(settings: ServeSettings, *, on_event: EventHook | None = None, follow: bool = True) -> Starlette:
    """The application; `follow=False` leaves the follower's thread off (tests call `follower.check()`)."""
    follower = ChampionFollower(settings, on_event)
    page_html = resources.files("cifar.endpoint").joinpath("page.html").read_text(encoding="utf-8")  # Read once.
    batcher = Batcher(settings.max_batch, settings.max_wait_ms / 1000, settings.max_queued_images)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        await batcher.start()
        # TensorFlow's and MLflow's millions of objects out of the collector's sight: a full collection
        # otherwise walks them all, triggered by the objects of large JSON requests (a p99 of ~0.5 s, measured).
        gc.freeze()
        if follow:
            follower.start()
        try:
            yield
        finally:
            follower.stop()
            await batcher.stop()

    def served() -> ServedVersion:
        current = follower.current  # Read once: this request runs on this version to the end.
        if current is None:
            raise Unavailable(follower.last_error or f"no verified version of {settings.model_uri} yet")
        return current

    async def classify(images: Images) -> tuple[ServedVersion, np.ndarray]:
        version = served()
        return version, await batcher.submit(version, images.images)

    async def predict(request: Request) -> Response:
        top_k = requested_top_k(request, settings)
        images = await read_photos(request, settings)
        version, probabilities = await classify(images)
        k = min(top_k, len(version.class_names))
        order = np.argsort(-probabilities, axis=1, kind="stable")[:, :k]
        predictions = [
            {
                "file": name,
                "top_k": [
                    {"class": version.class_names[index], "probability": round(float(row[index]), 6)}
                    for index in ranked
                ],
            }
            for name, row, ranked in zip(images.names, probabilities, order, strict=True)
        ]
        return answer(version, {"model": version.model_name, "version": version.version, "predictions": predictions})

    async def invocations(request: Request) -> Response:
        images = await read_tensor(request, settings)
        version, probabilities = await classify(images)
        class_ids = probabilities.argmax(axis=1)
        outputs = {
            "class_ids": class_ids.tolist(),
            "class_names": [version.class_names[index] for index in class_ids],
            "probabilities": probabilities.astype(float).round(7).tolist(),
        }
        return answer(version, {"predictions": outputs, "model": version.model_name, "version": version.version})

    async def live(request: Request) -> Response:
        return JSONResponse({"live": True})

    async def ready(request: Request) -> Response:
        current = follower.current
        if current is None:
            return unavailable(follower.last_error or "no verified version yet", settings)
        return answer(current, {"ready": True, "version": current.version})

    async def version(request: Request) -> Response:
        status = follower.status() | {"queued_images": batcher.queued_images, "model_calls": batcher.calls,
                                      "images_classified": batcher.images}  # fmt: skip
        return JSONResponse(status)

    async def page(request: Request) -> Response:
        return HTMLResponse(page_html)

    async def model_card(request: Request) -> Response:
        current = served()
        card = await anyio.to_thread.run_sync(follower.model_card, current)
        if card is None:
            return JSONResponse({"error": f"version {current.version} has no model card"}, status_code=404)
        return HTMLResponse(card, headers={VERSION_HEADER: str(current.version)})

    async def bad_request(request: Request, error: Exception) -> Response:
        return JSONResponse({"error": str(error), "error_code": "BAD_REQUEST"}, status_code=400)

    async def overloaded(request: Request, error: Exception) -> Response:
        return unavailable(f"overloaded: {error}", settings)

    async def not_ready(request: Request, error: Exception) -> Response:
        return unavailable(str(error), settings)

    app = Starlette(
        routes=[
            Route("/", page),
            Route("/predict", predict, methods=["POST"]),
            Route("/invocations", invocations, methods=["POST"]),
            Route("/version", version),
            Route("/model-card", model_card),
            Route("/health/live", live),
            Route("/health/ready", ready),
            Route("/ping", ready),
        ],
        exception_handlers={BadRequest: bad_request, Overloaded: overloaded, Unavailable: not_ready},
        lifespan=lifespan,
    )
    app.state.follower, app.state.batcher = follower, batcher
    return app


def requested_top_k(request: Request, settings: ServeSettings) -> int:
    text = request.query_params.get("top_k")
    if text is None:
        return settings.top_k
    if not text.isdigit() or not 1 <= int(text) <= 10:
        raise BadRequest(f"top_k must be an integer from 1 to 10, got {text[:20]!r}")
    return int(text)


def answer(version: ServedVersion, body: dict) -> Response:
    return JSONResponse(body, headers={VERSION_HEADER: str(version.version)})


def unavailable(reason: str, settings: ServeSettings) -> Response:
    return JSONResponse(
        {"error": reason, "error_code": "UNAVAILABLE"},
        status_code=503,
        headers={"Retry-After": str(settings.retry_after_seconds)},
    )
