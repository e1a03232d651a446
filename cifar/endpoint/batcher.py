"""Concurrent requests gathered into one model call, with a bounded queue.

Why: one call on 64 images costs little more than one on a single image on 2 cores (the model's own speed
grows with the batch, docs/BENCHMARKS.md "Serving"), so 64 clients each sending one photo are served
together. The first request waits at most `max_wait` for others; a call takes at most `max_batch` images
(a single request with more runs alone). While a call runs, the next batch gathers. Each request runs on the
version it was accepted with: a batch takes only requests of one version, so a switch drops nothing.

Beyond `max_queued_images` waiting, `submit` raises Overloaded at once (the endpoint answers 503 with
Retry-After) instead of letting latency grow without bound.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from cifar.endpoint.versions import ServedVersion

logger = logging.getLogger(__name__)


class Overloaded(RuntimeError):
    """More images are waiting than the queue holds."""


@dataclass
class Job:
    images: np.ndarray
    version: ServedVersion
    future: asyncio.Future


class Batcher:
    def __init__(self, max_batch: int, max_wait_seconds: float, max_queued_images: int) -> None:
        self.max_batch, self.max_wait, self.max_queued = max_batch, max_wait_seconds, max_queued_images
        self._queue: collections.deque[Job] = collections.deque()
        self._queued_images = 0
        self._arrived: asyncio.Event | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._task: asyncio.Task | None = None
        self.calls = 0
        self.images = 0

    async def start(self) -> None:
        self._arrived = asyncio.Event()
        # One model call at a time: TensorFlow spreads one call over every core itself.
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="model")
        self._task = asyncio.create_task(self._run(), name="batcher")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for job in self._queue:
            if not job.future.done():
                job.future.set_exception(Overloaded("the endpoint is stopping"))
        self._executor.shutdown(wait=False, cancel_futures=True)

    @property
    def queued_images(self) -> int:
        return self._queued_images

    async def submit(self, version: ServedVersion, images: np.ndarray) -> np.ndarray:
        """Probabilities (N, classes) of `images` (N, 32, 32, 3) uint8 from `version`."""
        if self._queued_images and self._queued_images + len(images) > self.max_queued:
            raise Overloaded(f"{self._queued_images} images are waiting (at most {self.max_queued})")
        job = Job(images, version, asyncio.get_running_loop().create_future())
        self._queue.append(job)
        self._queued_images += len(images)
        self._arrived.set()
        return await job.future

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._queue:
                self._arrived.clear()
                await self._arrived.wait()
                continue
            await self._gather(loop)
            batch = self._take()
            images = batch[0].images if len(batch) == 1 else np.concatenate([job.images for job in batch])
            try:
                probabilities = await loop.run_in_executor(self._executor, batch[0].version.classify, images)
            except Exception as error:  # noqa: BLE001 - handed to every request of the batch.
                logger.exception("model call on %d images failed", len(images))
                for job in batch:
                    if not job.future.done():
                        job.future.set_exception(error)
                continue
            self.calls, self.images = self.calls + 1, self.images + len(images)
            start = 0
            for job in batch:
                if not job.future.done():  # A client that went away leaves a cancelled future.
                    job.future.set_result(probabilities[start : start + len(job.images)])
                start += len(job.images)

    async def _gather(self, loop: asyncio.AbstractEventLoop) -> None:
        """Waits up to max_wait for the head's version to have a full batch queued."""
        deadline = loop.time() + self.max_wait
        head = self._queue[0].version
        while sum(len(job.images) for job in self._queue if job.version is head) < self.max_batch:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), remaining)
            except TimeoutError:
                return

    def _take(self) -> list[Job]:
        """The head job and the queued jobs of its version after it, up to max_batch images in all."""
        head = self._queue.popleft()
        batch, count, kept = [head], len(head.images), collections.deque()
        while self._queue:
            job = self._queue.popleft()
            if job.version is head.version and count + len(job.images) <= self.max_batch:
                batch.append(job)
                count += len(job.images)
            else:
                kept.append(job)
        self._queue = kept
        self._queued_images -= count
        return batch
