"""Fuzzing the serving door: REST bodies POSTed to the endpoint's /invocations (cifar/endpoint), in process.

Given any body (images that keep the contract, images with one value broken, ragged or reshaped lists, other
keys, any JSON, any text, nesting thousands deep), expect 200 with the model's answer on exactly the images
sent, or a one-line 400; never a 500, never a value silently cast. The model is a stand-in without TensorFlow
whose answer is each image's pixel sum modulo 10, so an answer on other images than those sent shows.
"""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import pytest
from fuzz_strategies import budget, request_bodies
from hypothesis import given

from cifar.endpoint.app import create_app
from cifar.endpoint.settings import settings_from
from cifar.endpoint.versions import ServedVersion


def pixel_sum_classes(images: np.ndarray) -> np.ndarray:
    """One-hot probabilities of each image's pixel sum modulo 10."""
    classes = images.reshape(len(images), -1).sum(axis=1, dtype=np.int64) % 10
    return np.eye(10, dtype=np.float32)[classes]


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    endpoint = create_app(settings_from({"tracking_uri": "sqlite:///unused.db"}, environ={}), follow=False)
    endpoint.state.follower.current = ServedVersion(
        model_name="stand-in", version=7, run_id=None, class_names=tuple("0123456789"),
        classify=pixel_sum_classes, verified="a stand-in",
    )  # fmt: skip
    return endpoint


def invoke(app, body: str) -> tuple[int, dict]:
    """The HTTP status and JSON reply the endpoint gives `body`."""

    async def post() -> httpx.Response:
        await app.state.batcher.start()
        try:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://endpoint") as client:
                return await client.post(
                    "/invocations", content=body.encode("utf-8", "surrogatepass"),
                    headers={"Content-Type": "application/json"},
                )  # fmt: skip
        finally:
            await app.state.batcher.stop()

    reply = asyncio.run(post())
    return reply.status_code, reply.json()


@budget(3)
@given(request=request_bodies())
def test_a_request_is_answered_on_exactly_its_images_or_refused_with_400(app, request):
    body, images, valid = request
    status, reply = invoke(app, body)
    assert status in (200, 400), reply
    if status == 200:
        assert valid and images is not None, f"answered a request that breaks the contract: {body[:200]}"
        expected = images.reshape(len(images), -1).sum(axis=1, dtype=np.int64) % 10
        assert reply["predictions"]["class_ids"] == expected.tolist() and reply["version"] == 7
    else:
        assert not valid or len(images) > 256, reply  # 256: the default limit of images per JSON request.
        assert reply["error_code"] == "BAD_REQUEST" and "\n" not in reply["error"], reply


def test_a_body_nested_past_the_recursion_limit_is_refused_with_400(app):
    """MLflow's scoring server answers this 500 (mlflow/mlflow#4897: json.loads hits the recursion limit); the
    endpoint answers 400."""
    status, reply = invoke(app, '{"inputs": ' + "[" * 100_000 + "]" * 100_000 + "}")
    assert status == 400 and "nested deeper" in reply["error"], reply
