"""The reward server behind `python -m tools.rewards serve`: a FastAPI app scoring loaded rewards for `remote` rewards.

    GET  /health          {"status": "ok", "rewards": [names]}
    POST /score/{name}    safetensors body: images, prompts, metadata (grpo/rewards/remote.py) -> safetensors
                          {"scores": float32 [B]}

One worker thread scores: a model is never run by two threads at once, and requests that wait together are scored
together. It takes the first waiting request, then whatever else arrives within `wait_s` (up to `max_images`
images), and scores each group of one reward and one image size as one batch (the reward still splits it by its
batch_size). With N ranks sending at once, the server runs one batch of N ranks' images instead of N small ones.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import defaultdict
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from torch import Tensor

from grpo.rewards.openclip_loader import first_line
from grpo.rewards.registry import Rewards
from grpo.rewards.base import per_sample
from grpo.rewards.remote import decode_request, encode_scores

__all__ = ["Batcher", "make_app"]

logger = logging.getLogger(__name__)


@dataclass
class _Job:
    name: str
    images: Tensor  # uint8 [B, 3, H, W]
    prompts: list[str]
    metadata: list[dict]  # one dict per image: its dataset metadata, {} when the client sent none
    future: Future = field(default_factory=Future)


class Batcher:
    """Scores submitted requests in one worker thread, grouping those that arrive within `wait_s` of each other.

    Args:
        rewards: the loaded rewards (their names are what clients ask for).
        max_images: stop collecting a batch at this many images.
        wait_s: how long the first request of a batch waits for others.
    """

    def __init__(self, rewards: Rewards, max_images: int = 64, wait_s: float = 0.01) -> None:
        self.rewards = rewards
        self.max_images = max_images
        self.wait_s = wait_s
        self.batches = 0  # batches scored (tests and logs read it)
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="reward-batcher", daemon=True)
        self._thread.start()

    def submit(self, name: str, images: Tensor, prompts: list[str], metadata: list[dict] | None = None) -> Future:
        """Queues uint8 images of one reward; the future gets float32 [B] scores on the CPU, or the scoring error."""
        job = _Job(name, images, prompts, per_sample(metadata, len(prompts)))
        self._queue.put(job)
        return job.future

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _collect(self, first: _Job) -> tuple[list[_Job], bool]:
        jobs, count = [first], len(first.prompts)
        deadline = time.monotonic() + self.wait_s
        while count < self.max_images:
            remaining = deadline - time.monotonic()
            try:
                job = self._queue.get(timeout=remaining) if remaining > 0 else self._queue.get_nowait()
            except queue.Empty:
                break
            if job is None:
                return jobs, True
            jobs.append(job)
            count += len(job.prompts)
        return jobs, False

    def _run(self) -> None:
        stop = False
        while not stop:
            first = self._queue.get()
            if first is None:
                return
            jobs, stop = self._collect(first)
            self.batches += 1  # before scoring: a request's answer may be read before this thread goes on
            groups: dict[tuple, list[_Job]] = defaultdict(list)
            for job in jobs:
                groups[(job.name, tuple(job.images.shape[1:]))].append(job)
            for (name, _), group in groups.items():
                self._score(name, group)

    def _score(self, name: str, jobs: list[_Job]) -> None:
        try:
            images = torch.cat([j.images for j in jobs]).float().div_(255)  # uint8 levels: exact in float32
            prompts = [p for j in jobs for p in j.prompts]
            metadata = [m for j in jobs for m in j.metadata]
            scores = self.rewards[name](images, prompts, metadata).float().cpu()
        except Exception as err:  # a reward's failure goes back to the requests that asked for it
            logger.error("scoring %d requests with %s failed: %s", len(jobs), name, first_line(err))
            for j in jobs:
                j.future.set_exception(err)
            return
        start = 0
        for j in jobs:
            j.future.set_result(scores[start : start + len(j.prompts)].clone())
            start += len(j.prompts)


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def make_app(batcher: Batcher) -> FastAPI:
    """The HTTP app over `batcher` (run it with uvicorn)."""
    app = FastAPI(title="GRPO reward server", docs_url=None, redoc_url=None)
    names = list(batcher.rewards.names)

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok", "rewards": names}

    @app.post("/score/{name}")
    async def score(name: str, request: Request) -> Response:
        if name not in names:
            return _error(404, f"reward {name!r} is not served here; served: {', '.join(names)}")
        try:
            images, prompts, metadata = decode_request(await request.body())
        except ValueError as err:
            return _error(400, str(err))
        try:
            scores = await asyncio.wrap_future(batcher.submit(name, images, prompts, metadata))
        except Exception as err:
            return _error(500, f"{name}: {first_line(err)}")
        return Response(encode_scores(scores), media_type="application/octet-stream")

    return app
