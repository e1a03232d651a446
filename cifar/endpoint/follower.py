"""Follows `models:/NAME@ALIAS`: when the alias moves (the gate, a person, a rollback), the new version is
fetched, loaded beside the running one, verified, then switched to in one assignment.

Requests hold the version they started with (cifar.endpoint.batcher runs each on the version it was
accepted with), so a switch drops nothing. A version that fails verification is refused: logged, kept in
`status()`, announced through `on_event`, and not tried again until the alias points elsewhere; the running
version keeps serving. MLflow has no notification of an alias moving, so the alias is read every
`poll_seconds` (one small REST call); a switch is seen within that, plus the load (docs/BENCHMARKS.md).
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from cifar.endpoint.settings import ServeSettings
from cifar.endpoint.versions import ServedVersion, VersionRefused, load_version, model_card_html, one_line

logger = logging.getLogger(__name__)

EventHook = Callable[[str, dict[str, Any]], None]  # (event name, payload): flows/serve.py sends Prefect events.
REFUSED_EVENT = "cifar.serving.version.refused"
SWITCHED_EVENT = "cifar.serving.version.switched"


class ChampionFollower:
    def __init__(self, settings: ServeSettings, on_event: EventHook | None = None) -> None:
        self.settings = settings
        self.on_event = on_event or (lambda name, payload: None)
        self.current: ServedVersion | None = None  # Replaced whole, never changed in place: readers need no lock.
        self.refused: dict[int, str] = {}  # Version -> why, while the alias points at it.
        self.last_check: float | None = None
        self.last_error: str | None = None
        self.switches: list[dict[str, Any]] = []  # The last few, for /version.
        self._cards: dict[int, str | None] = {}
        self._client = None  # mlflow.MlflowClient, made at the first look (MLflow is imported there).
        self._check_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --- The loop. ---------------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="champion-follower", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.check()
            self._stop.wait(self.settings.poll_seconds)

    def check(self) -> None:
        """Reads the alias once; loads, verifies and switches when it names another version. Never raises."""
        with self._check_lock:
            try:
                self._check()
                self.last_error = None
            except Exception as error:  # noqa: BLE001 - an unreachable registry: keep serving what we have.
                self.last_error = one_line(error)
                logger.warning("could not read %s: %s", self.settings.model_uri, self.last_error)
            finally:
                self.last_check = time.time()

    def _check(self) -> None:
        import mlflow

        if self._client is None:  # One client for the endpoint's life: its store is opened once.
            self._client = mlflow.MlflowClient(tracking_uri=self.settings.tracking_uri)
        client = self._client
        try:
            target = int(client.get_model_version_by_alias(self.settings.model_name, self.settings.alias).version)
        except mlflow.exceptions.MlflowException as error:
            if error.get_http_status_code() == 404 or "RESOURCE_DOES_NOT_EXIST" in str(error.error_code):
                self.last_error = f"{self.settings.model_uri} does not exist yet"
                return
            raise
        if self.current is not None and self.current.version == target:
            self.refused.clear()  # Back on the serving version: a later move to a refused one is tried again.
            return
        if target in self.refused:
            return
        self.refused.clear()
        previous = self.current.version if self.current else None
        logger.info("%s is version %s (serving %s): loading it", self.settings.model_uri, target, previous)
        try:
            loaded = load_version(client, self.settings.tracking_uri, self.settings.model_name, target,
                                  self.settings.cache_dir)  # fmt: skip
        except VersionRefused as refusal:
            self.refused[target] = str(refusal)
            logger.error("refused version %s of %s: %s; still serving %s", target, self.settings.model_name,
                         refusal, previous)  # fmt: skip
            self.on_event(REFUSED_EVENT, self._payload(target, previous, reason=str(refusal)))
            return
        self.current = loaded  # The switch: requests accepted from here on run on `loaded`.
        gc.freeze()  # The loaded graph's objects too out of the collector's walks (cifar.endpoint.app).
        self.switches = [*self.switches[-9:], {"from": previous, "to": target, "at": loaded.describe()["loaded_at"]}]
        logger.info("serving version %s of %s (was %s; %s; loaded in %.1f s)", target, self.settings.model_name,
                    previous, loaded.verified, loaded.load_seconds)  # fmt: skip
        self.on_event(SWITCHED_EVENT, self._payload(target, previous, verified=loaded.verified))

    def _payload(self, version: int, previous: int | None, **extra: Any) -> dict[str, Any]:
        return {"model": self.settings.model_name, "alias": self.settings.alias, "version": version,
                "serving": previous, **extra}  # fmt: skip

    # --- What the endpoint tells. ------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self.current is not None

    def status(self) -> dict[str, Any]:
        current = self.current
        return {
            "model_uri": self.settings.model_uri,
            "serving": current.describe() if current else None,
            "refused": [{"version": version, "reason": reason} for version, reason in self.refused.items()],
            "switches": self.switches,
            "last_check": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.last_check))
            if self.last_check
            else None,
            "last_error": self.last_error,
            "poll_seconds": self.settings.poll_seconds,
        }

    def model_card(self, served: ServedVersion) -> str | None:
        """The served version's model card (fetched once per version)."""
        if served.version not in self._cards:
            self._cards = {served.version: model_card_html(self.settings.tracking_uri, served.run_id)}
        return self._cards[served.version]
