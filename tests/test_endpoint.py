"""The endpoint (cifar/endpoint, `flows/serve.py`): photos and JSON in, the champion followed, batching, limits.

One registry for the module: version 1 and 2 of a tiny trained model (two trainings) and a version 3 whose files
are damaged after registration. Input forms and limits run in process (Starlette's test client); the switch
under concurrent clients and the overload run through a real uvicorn on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import io
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import mlflow
import numpy as np
import pytest
from PIL import Image
from test_evaluate import prepare_fixture_data, write_checkpoints

from cifar.config import make_config
from cifar.data.additions import decode_image
from cifar.endpoint.app import VERSION_HEADER, create_app
from cifar.endpoint.follower import REFUSED_EVENT, SWITCHED_EVENT
from cifar.endpoint.settings import ServeSettings, settings_from
from cifar.evaluate import evaluate, load_split
from cifar.export import export_model, serving_outputs
from cifar.registry import register_and_promote
from cifar.serving_contract import CONTRACT
from harness.ports import free_port

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def registry(tmp_path_factory, python_archive) -> dict:
    """Versions 1, 2 and 3 (three trainings), version 3's variables damaged in the store after registration."""
    workdir = tmp_path_factory.mktemp("endpoint") / "workdir"
    data_dir = prepare_fixture_data(python_archive, workdir)
    tracking_uri = f"sqlite:///{workdir / 'mlflow.db'}"
    images, _ = load_split(data_dir, "test")
    exports = []
    for seed in (0, 1, 2):
        # The three checkpoint indexes look alike (same names and epochs): a batch size of their own gives each
        # training its own evaluation, export and registration keys.
        config = make_config(
            "default",
            {"train": {"model": "tiny"}, "evaluate": {"flip_tta": False, "batch_size": 100 + seed},
             "tracking": {"tracking_uri": tracking_uri}, "export": {"card_robustness_examples": 100}},
        )  # fmt: skip
        trained = workdir / f"seed{seed}"
        checkpoint_dir = trained / "runs" / "tiny" / "checkpoints"
        write_checkpoints(data_dir, checkpoint_dir, epochs=1, seed=seed)
        evaluation = evaluate(config, data_dir, checkpoint_dir, trained, mlflow_run_id=None, tracking_uri=None)
        exported = export_model(config, data_dir, checkpoint_dir, trained, evaluation)
        register_and_promote(config, exported, data_dir, input_example=images[:2], evaluation=evaluation)
        exports.append(exported)
    client = mlflow.MlflowClient(tracking_uri=tracking_uri)
    client.set_registered_model_alias("cifar10", "champion", "1")
    damaged = Path(client.get_model_version_download_uri("cifar10", "3").removeprefix("file://"))
    (variables,) = damaged.rglob("variables.data-*")
    variables.write_bytes(variables.read_bytes()[:100])  # Truncated, as a half-copied file would be.
    return {"tracking_uri": tracking_uri, "images": images, "exports": exports, "client": client}


def settings(registry, **changes) -> ServeSettings:
    return settings_from({"tracking_uri": registry["tracking_uri"], "poll_seconds": 0.2, **changes}, environ={})


def png(image: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="PNG")
    return buffer.getvalue()


def photo(size=(300, 200), kind="JPEG", mode="RGB") -> bytes:
    pixels = np.random.default_rng(3).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).convert(mode).save(buffer, format=kind)
    return buffer.getvalue()


def expected(export, images: np.ndarray) -> np.ndarray:
    return serving_outputs(export.export_dir, images, batch_size=len(images))["probabilities"]


def test_every_input_form_is_answered_by_the_served_version(registry):
    images, (first, *_) = registry["images"], registry["exports"]
    app = create_app(settings(registry), follow=False)
    with LiveServer(app) as url, httpx.Client(base_url=url, timeout=60) as client:
        assert client.get("/health/live").status_code == 200
        waiting = client.get("/health/ready")  # Nothing verified yet: not ready, and says when to retry.
        assert waiting.status_code == 503 and waiting.headers["Retry-After"] == "1"
        assert client.post("/predict", content=png(images[0]), headers={"Content-Type": "image/png"}).status_code == 503
        app.state.follower.check()
        assert client.get("/health/ready").json() == {"ready": True, "version": 1}
        status = client.get("/version").json()
        assert status["serving"]["version"] == 1 and "probe images as recorded" in status["serving"]["verified"]

        reply = client.post("/predict?top_k=3", content=png(images[0]), headers={"Content-Type": "image/png"})
        assert reply.status_code == 200 and reply.headers[VERSION_HEADER] == "1", reply.text
        body = reply.json()
        assert (body["model"], body["version"]) == ("cifar10", 1)
        (prediction,) = body["predictions"]
        probabilities = expected(first, images[:1])[0]
        ranked = np.argsort(-probabilities)[:3]
        assert [entry["probability"] for entry in prediction["top_k"]] == pytest.approx(probabilities[ranked], abs=1e-5)
        assert prediction["file"] == "body" and len(prediction["top_k"]) == 3

        # A photo of another size, resized as ingestion and batch prediction resize it.
        jpeg = photo((300, 200))
        reply = client.post("/predict?top_k=10", content=jpeg, headers={"Content-Type": "image/jpeg"})
        resized, problem = decode_image(jpeg, "bilinear")
        assert reply.status_code == 200 and problem is None, reply.text
        top = reply.json()["predictions"][0]["top_k"]
        assert len(top) == 10 and top[0]["probability"] == pytest.approx(expected(first, resized[None]).max(), abs=1e-5)

        files = [("files", (f"test-{index}.png", png(images[index]), "image/png")) for index in range(3)]
        reply = client.post("/predict", files=files)
        assert reply.status_code == 200, reply.text
        assert [entry["file"] for entry in reply.json()["predictions"]] == ["test-0.png", "test-1.png", "test-2.png"]

        reply = client.post("/invocations", json={"inputs": images[:4].tolist()})
        assert reply.status_code == 200 and reply.headers[VERSION_HEADER] == "1", reply.text
        outputs = serving_outputs(first.export_dir, images[:4], batch_size=4)
        assert reply.json()["predictions"]["class_ids"] == outputs["class_ids"].tolist()
        assert reply.json()["version"] == 1
        assert '<input id="file"' in client.get("/").text
        card = client.get("/model-card")  # The served version's card, from its run's artifacts.
        assert card.status_code == 200 and card.headers[VERSION_HEADER] == "1"
        assert "<title>cifar10 v1</title>" in card.text


@pytest.mark.parametrize(
    ("request_kwargs", "message"),
    [
        ({"content": b"hello", "headers": {"Content-Type": "image/png"}}, "body: not a usable photo (undecodable"),
        ({"content": photo((40, 30), kind="GIF"), "headers": {"Content-Type": "image/png"}}, "(format: GIF image"),
        ({"content": photo((40, 30), "PNG", "L"), "headers": {"Content-Type": "image/png"}}, "(mode: not an RGB"),
        ({"content": photo((200, 100)), "headers": {"Content-Type": "image/jpeg"}}, "over the 10,000 pixels"),
        ({"content": b"x" * 70_000, "headers": {"Content-Type": "image/png"}}, "over the limit of 65,536"),
        ({"content": b"", "headers": {"Content-Type": "image/png"}}, "body: an empty file"),
        ({"content": b"{}", "headers": {"Content-Type": "text/plain"}}, "Content-Type text/plain is not a photo"),
        ({"files": [("f", (f"{i}.png", b"x", "image/png")) for i in range(3)]}, "too many files: at most 2"),
        ({"data": {"note": "hi"}, "files": [("f", ("a.png", b"x", "image/png"))]}, "field 'note' is not a file"),
        ({"content": b"--x\r\n", "headers": {"Content-Type": "multipart/form-data"}}, "multipart body cannot be read"),
    ],
    ids=["not an image", "GIF", "grey", "too many pixels", "too many bytes", "empty", "text", "too many files",
         "a text field", "no boundary"],
)  # fmt: skip
def test_a_bad_photo_request_gets_one_line_400(registry, request_kwargs, message):
    app = create_app(settings(registry, max_pixels=10_000, max_request_bytes=65_536, max_files=2), follow=False)
    app.state.follower.check()
    with LiveServer(app) as url, httpx.Client(base_url=url, timeout=60) as client:
        reply = client.post("/predict", **request_kwargs)
    assert reply.status_code == 400, reply.text
    assert message in reply.json()["error"] and "\n" not in reply.json()["error"], reply.json()


def test_a_bad_tensor_request_gets_one_line_400_and_deep_nesting_is_no_500(registry):
    images = registry["images"][:2]
    app = create_app(settings(registry, max_json_images=3), follow=False)
    app.state.follower.check()
    with LiveServer(app) as url, httpx.Client(base_url=url, timeout=60) as client:
        cases = {
            "floats": (client.post("/invocations", json={"inputs": (images / 255).tolist()}), "got floating-point"),
            "too many": (client.post("/invocations", json={"inputs": [images[0].tolist()] * 4}), "over the limit of 3"),
            "other keys": (client.post("/invocations", json={"instances": []}), 'must be {"inputs": ...}'),
            "not JSON": (client.post("/invocations", content=b"{", headers={"Content-Type": "application/json"}),
                         "not JSON"),
            "nested": (client.post("/invocations", content=b'{"inputs": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
                                   headers={"Content-Type": "application/json"}), "nested deeper"),
            "empty": (client.post("/invocations", json={"inputs": np.zeros((0, 32, 32, 3)).tolist()}), "shape"),
            "photo type": (client.post("/invocations", content=b"x", headers={"Content-Type": "image/png"}),
                           "is not application/json"),
            "top_k": (client.post("/predict?top_k=0", content=png(images[0]), headers={"Content-Type": "image/png"}),
                      "top_k must be an integer from 1 to 10"),
        }  # fmt: skip
    for name, (reply, message) in cases.items():
        assert reply.status_code == 400, (name, reply.text)
        assert message in reply.json()["error"], (name, reply.json())
    assert cases["floats"][0].json()["error"].endswith(CONTRACT)


class LiveServer:
    """The application under a real uvicorn on 127.0.0.1, in a thread."""

    def __init__(self, app) -> None:
        import uvicorn

        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def test_the_alias_moves_under_concurrent_clients_without_a_failed_answer(registry):
    client, images = registry["client"], registry["images"]
    events: list[tuple[str, dict]] = []
    app = create_app(settings(registry), on_event=lambda name, payload: events.append((name, payload)))
    answers: dict[int, list[int]] = {worker: [] for worker in range(8)}
    failures: list[str] = []
    stop = threading.Event()

    def hammer(worker: int, url: str) -> None:
        body = png(images[worker])
        with httpx.Client(timeout=60) as session:
            while not stop.is_set():
                reply = session.post(f"{url}/predict", content=body, headers={"Content-Type": "image/png"})
                if reply.status_code != 200:
                    failures.append(f"{reply.status_code} {reply.text[:200]}")
                    continue
                assert int(reply.headers[VERSION_HEADER]) == reply.json()["version"]
                answers[worker].append(reply.json()["version"])

    def wait_for_version(url: str, version: int) -> float:
        started = time.monotonic()
        while (httpx.get(f"{url}/version").json()["serving"] or {}).get("version") != version:
            assert time.monotonic() - started < 60, f"version {version} not served within 60 s"
            time.sleep(0.1)
        return time.monotonic() - started

    with LiveServer(app) as url, ThreadPoolExecutor(8) as pool:
        wait_for_version(url, 1)
        running = [pool.submit(hammer, worker, url) for worker in range(8)]
        time.sleep(1)
        client.set_registered_model_alias("cifar10", "champion", "2")  # A promotion.
        seconds = wait_for_version(url, 2)
        time.sleep(1)
        client.set_registered_model_alias("cifar10", "champion", "3")  # Damaged files: refused.
        deadline = time.monotonic() + 60
        while not (refused := httpx.get(f"{url}/version").json()["refused"]) and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1)
        client.set_registered_model_alias("cifar10", "champion", "1")  # The rollback.
        wait_for_version(url, 1)
        time.sleep(1)
        stop.set()
        for future in running:
            future.result()
    print(f"switch seen and loaded in {seconds:.1f} s; answers per client: {[len(a) for a in answers.values()]}")

    assert not failures, failures[:5]
    assert refused and refused[0]["version"] == 3 and "does not load" in refused[0]["reason"], refused
    for versions in answers.values():  # Each client saw the alias's history in order, never an old version again.
        seen = [version for index, version in enumerate(versions) if index == 0 or versions[index - 1] != version]
        assert seen in ([1, 2, 1], [2, 1], [1, 2], [1], [2]) and 3 not in versions, seen
        assert len(versions) > 10
    assert [name for name, _ in events] == [SWITCHED_EVENT, SWITCHED_EVENT, REFUSED_EVENT, SWITCHED_EVENT]
    assert events[2][1]["version"] == 3 and events[2][1]["serving"] == 2


def test_an_overload_is_answered_503_with_retry_after_and_nothing_else(registry):
    images = registry["images"]
    app = create_app(settings(registry, max_batch=2, max_queued_images=4, max_wait_ms=50), follow=False)

    async def burst() -> list[httpx.Response]:
        await app.state.batcher.start()
        try:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://endpoint") as session:
                return await asyncio.gather(*(
                    session.post("/predict", content=png(images[index]), headers={"Content-Type": "image/png"})
                    for index in range(40)
                ))  # fmt: skip
        finally:
            await app.state.batcher.stop()

    app.state.follower.check()
    replies = asyncio.run(burst())
    codes = sorted({reply.status_code for reply in replies})
    assert codes == [200, 503], codes
    for reply in replies:
        if reply.status_code == 503:
            assert reply.headers["Retry-After"] == "1" and "overloaded" in reply.json()["error"]
    served = [reply for reply in replies if reply.status_code == 200]
    assert len(served) >= 4 and app.state.batcher.calls < len(served)  # Requests shared model calls.
    assert json.loads(served[0].text)["version"] == 1
