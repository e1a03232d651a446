"""The same endpoint on Ray Serve, for bench/serving.py's side-by-side rows (`--ray-python`): one PNG per request to
/predict, decoded as ours decodes it, batched by `@serve.batch` (the same max batch and wait as our defaults),
the same SavedModel and the same top-3 answer.

    RAY_PYTHON bench/ray_endpoint.py EXPORT_DIR PORT     # then POST image/png to http://127.0.0.1:PORT/predict

Ray Serve is not a dependency of the project (docs/BENCHMARKS.md "Serving" says why): run this with an
interpreter that has `ray[serve]` beside the project's packages.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import ray  # noqa: E402
from ray import serve  # noqa: E402
from starlette.requests import Request  # noqa: E402
from starlette.responses import JSONResponse  # noqa: E402

from cifar.endpoint.settings import ServeSettings  # noqa: E402

DEFAULTS = ServeSettings(tracking_uri="unused")


@serve.deployment(max_ongoing_requests=256)
class Classifier:
    def __init__(self, export_dir: str) -> None:
        from cifar.endpoint.versions import load_saved_model

        self.classify, self.class_names = load_saved_model(Path(export_dir))

    @serve.batch(max_batch_size=DEFAULTS.max_batch, batch_wait_timeout_s=DEFAULTS.max_wait_ms / 1000)
    async def predict(self, images: list[np.ndarray]) -> list[np.ndarray]:
        probabilities = self.classify(np.stack(images))
        return list(probabilities)

    async def __call__(self, request: Request) -> JSONResponse:
        from cifar.data.additions import decode_image

        image, problem = decode_image(await request.body(), DEFAULTS.resize)
        if problem is not None:
            return JSONResponse({"error": problem[1]}, status_code=400)
        row = await self.predict(image)
        ranked = np.argsort(-row)[:3]
        top = [{"class": self.class_names[index], "probability": float(row[index])} for index in ranked]
        return JSONResponse({"predictions": [{"file": "body", "top_k": top}]})


def main() -> None:
    export_dir, port = sys.argv[1], int(sys.argv[2])
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(Classifier.bind(export_dir), route_prefix="/predict")
    print("ready", flush=True)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()
