"""The model endpoint: the registry's champion over HTTP, following the alias without a restart.

    python flows/serve.py [--workdir W | --tracking-uri URI] [--host 127.0.0.1] [--port 5001]
                          [--model-name cifar10] [--alias champion] [--max-batch 64] [--max-wait-ms 4] ...
    curl --data-binary @cat.png -H 'Content-Type: image/png' http://127.0.0.1:5001/predict

Not a flow (a server runs for weeks, not a flow run), but a command of the same project: `make serve`, the
compose `serve` service and docs/PRODUCTION.md's Kubernetes notes all run it. Every knob is a flag and a
CIFAR_SERVE_* variable (cifar/endpoint/settings.py); the endpoint itself is cifar/endpoint/. With
PREFECT_API_URL set, a refused or switched version is also a Prefect event (cifar.serving.version.*), which
automations can act on.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # This checkout first, installed or not.

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # A server's log, not a terminal.

from cifar.endpoint.settings import ServeSettings, settings_from  # noqa: E402

logger = logging.getLogger("cifar.endpoint")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", default="./workdir", help="Serve WORKDIR/mlflow.db's registry (without a URI).")
    parser.add_argument("--tracking-uri", help="The MLflow server or store (default MLFLOW_TRACKING_URI).")
    parser.add_argument(
        "--host",
        default=os.environ.get("CIFAR_SERVE_HOST", "127.0.0.1"),
        help="Address to bind: 127.0.0.1 unless you mean to open it (the stack's proxy fronts it).",
    )
    parser.add_argument("--port", type=int, default=int(os.environ.get("CIFAR_SERVE_PORT", "5001")))
    parser.add_argument("--access-log", action="store_true", help="One log line per request (costs CPU under load).")
    for name, field in ServeSettings.model_fields.items():
        if name == "tracking_uri":
            continue
        flag = "--" + name.replace("_", "-")
        kind = {int: int, float: float}.get(field.annotation, str)
        parser.add_argument(flag, type=kind, default=None, help=f"{field.description or ''} Default {field.default}.")
    return parser.parse_args(argv)


def tracking_uri(args: argparse.Namespace) -> str:
    if args.tracking_uri:
        return args.tracking_uri
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    store = Path(args.workdir).expanduser().resolve() / "mlflow.db"
    if not store.exists():
        raise ValueError(f"no registry at {store}: give a pipeline's --workdir, --tracking-uri or MLFLOW_TRACKING_URI")
    return f"sqlite:///{store}"


def prefect_events() -> Any:
    """A hook sending the follower's events to Prefect when a server is configured, else None.

    A refusal's event id follows from the version and the reason (tasks/events.py): an endpoint restarted
    while the alias still points at a refused version refuses it again, and the team hears of it once.
    """
    if not os.environ.get("PREFECT_API_URL"):
        return None
    import uuid

    from cifar.endpoint.follower import REFUSED_EVENT
    from tasks.events import model_resource, send

    def hook(name: str, payload: dict[str, Any]) -> None:
        repeated = name != REFUSED_EVENT  # A switch may happen again (there and back); it is not notified.
        identity = f"{payload['model']}:{payload['version']}:{payload.get('reason')}"
        send(
            name,
            model_resource(payload["model"], payload["version"]),
            payload,
            uuid.uuid4().hex if repeated else identity,
        )

    return hook


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        values = {name: getattr(args, name, None) for name in ServeSettings.model_fields}
        settings = settings_from(values | {"tracking_uri": tracking_uri(args)})
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    import uvicorn

    from cifar.endpoint.app import create_app

    app = create_app(settings, on_event=prefect_events())
    logger.info("serving %s from %s on http://%s:%d", settings.model_uri, settings.tracking_uri, args.host, args.port)
    uvicorn.run(app, host=args.host, port=args.port, access_log=args.access_log, log_level="info",
                timeout_graceful_shutdown=30)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
