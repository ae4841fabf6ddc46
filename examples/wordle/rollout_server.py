"""Rollout workers as a service (on the environment host): groups generated against vLLM's inference routes, scored
by the environment, queued within the staleness bound, and handed to the trainer over HTTP.

    python -m examples.wordle.rollout_server --tokenizer DIR --vllm-url URL --env-url URL [--host H --port P]

The workers never hold the engine credential: they reach only vLLM's inference routes, and the environment with
its own token (``WORDLE_ENV_TOKEN``, :mod:`examples.wordle.env_server`). Production is sized to
consumption (:class:`~examples.wordle.rollouts.RolloutQueue`): a group that would be beyond the bound when the
trainer takes it is not started. The trainer takes groups with ``POST /v1/take``
(:class:`~examples.wordle.rollouts.RemoteRollouts`); every request but ``/healthz`` must carry
``WORDLE_ROLLOUT_TOKEN`` as a bearer token. Without it the service refuses to start, unless ``--insecure``.

It is served as the coordinator is (:mod:`examples.wordle.serving`): a request without the token is refused
from its head, before any body byte is read; bodies are capped (``--max-body-bytes``) even with the token;
heads, bodies and TLS handshakes that do not arrive in time are closed, and so are answers left unread and
requests pipelined past a small depth; connections are capped overall and per client address below the
open-files limit; and clients are logged by their socket's address.
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import httpx
from deltasync_coordinator.http import SizeLimits
from fastapi import FastAPI, HTTPException
from pydantic import BaseModel, ConfigDict, Field

from . import serving
from .env_server import env_client
from .rollouts import Group, LocalRollouts, Positions, wordle_producer
from .serving import MAX_HEADER_BYTES, Bearer, Credential

__all__ = ["RolloutService", "add_service_arguments", "create_app", "serve", "service_token"]

logger = logging.getLogger("wordle.rollout_server")
TOKEN_ENV = "WORDLE_ROLLOUT_TOKEN"
CREDENTIAL = Credential(
    env=TOKEN_ENV,
    service="the rollout service",
    sender="the trainer",
    may="take groups",
    does="takes groups and reads its stats",
)
MAX_BODY_BYTES = 64 << 10
"""A take's body is a few dozen bytes."""


class TakeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    trainer_version: int = Field(ge=0, description="the trainer's version now: groups beyond the bound are dropped")
    count: int = Field(ge=1, le=256, description="groups wanted (at most the service's --prompts-per-step)")
    timeout_s: float = Field(20.0, ge=0, le=60, allow_inf_nan=False, description="answer with fewer after this long")


class RolloutService:
    """The workers and their queue.

    Args:
        make_group: ``(prompt ids, session id, index) -> Group``.
        positions: where games start.
        workers: groups generated at a time.
        max_staleness: the bound (versions).
        per_step: groups the trainer takes per step.
        maxsize: groups queued or in flight at most (default: ``per_step * (max_staleness + 1)``, what can be
            consumed within the bound).
        probe: what vLLM serves now (:func:`~examples.wordle.rollouts.served_probe`).
    """

    def __init__(
        self,
        make_group: Any,
        positions: Positions,
        *,
        workers: int,
        max_staleness: int,
        per_step: int,
        maxsize: int | None = None,
        probe: Any = None,
    ) -> None:
        local = LocalRollouts(
            make_group,
            positions,
            workers=workers,
            max_staleness=max_staleness,
            per_step=per_step,
            maxsize=maxsize,
            probe=probe,
        )
        self._local, self.queue, self.workers = local, local.queue, local.workers
        self._take_lock = threading.Lock()  # one trainer: takes in order

    @property
    def _started(self) -> bool:
        return bool(self.workers.threads)

    def start(self, trainer_version: int) -> None:
        """Start the workers (the first take does: before it, vLLM may still serve its unlabelled start-up
        weights)."""
        self._local.start(trainer_version)

    def stop(self) -> None:
        self._local.stop()

    def take(self, trainer_version: int, count: int, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        groups: list[Group] = []
        waited = 0.0
        with self._take_lock:
            self.start(trainer_version)
            while len(groups) < count:
                group, w = self.queue.take(
                    trainer_version, self.workers.check, timeout_s=max(0.0, deadline - time.monotonic())
                )
                waited += w
                if group is None:
                    break
                groups.append(group)
        return {"groups": [g.to_json() for g in groups], "waited_s": waited, **self.stats()}

    def stats(self) -> dict[str, Any]:
        q = self.queue
        return {
            "dropped": q.dropped,
            "episodes": self.workers.episodes,
            "held_back_s": q.held_back_s,
            "staleness": {str(k): v for k, v in sorted(q.staleness.items())},
            "queued_or_in_flight": len(q._q) + q.in_flight,
            "served_version": q.served_version,
        }


def create_app(service: RolloutService, token: str | None, *, max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    """The service's routes. ``token``: the bearer token every request but ``/healthz`` must carry, checked before
    the body is read (``None``: no authentication, for ``--insecure`` only); an empty or short one is refused.
    Bodies over ``max_body_bytes`` get 413, with the token too."""
    from fastapi import Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse

    if token is not None:
        CREDENTIAL.check(token)
    app = FastAPI(title="Wordle rollout workers", version="1", openapi_url=None, docs_url=None, redoc_url=None)

    @app.exception_handler(RequestValidationError)
    def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        # the errors without the input: a NaN or an out-of-range float would not render as JSON
        errors = [{"loc": e.get("loc"), "msg": e.get("msg"), "type": e.get("type")} for e in exc.errors()]
        return JSONResponse({"detail": errors}, status_code=422)

    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/stats")
    def stats() -> dict[str, Any]:
        return service.stats()

    @app.post("/v1/take")
    def take(body: TakeRequest) -> dict[str, Any]:
        per_step = service.queue.per_step
        if body.count > per_step:
            # production is sized to per_step groups a version: a trainer that takes more would wait forever
            raise HTTPException(
                422,
                f"take {body.count} groups: this service was started with --prompts-per-step {per_step}; start it "
                "with the trainer's --prompts-per-step",
            )
        try:
            return service.take(body.trainer_version, body.count, body.timeout_s)
        except Exception as exc:  # noqa: BLE001 - a worker failed: the trainer stops with its reason
            raise HTTPException(500, f"{type(exc).__name__}: {exc}"[:2000]) from exc

    app.add_middleware(SizeLimits, max_bytes=max_body_bytes, max_header_bytes=MAX_HEADER_BYTES, close=True)
    if token is not None:
        app.add_middleware(
            Bearer, token=token, credential=CREDENTIAL
        )  # outermost: nothing of a refused request is read
    return app


def add_service_arguments(parser: argparse.ArgumentParser) -> None:
    """Where the service listens, its credential's escape hatch, and the bounds it serves with."""
    serving.add_service_arguments(parser, CREDENTIAL, port=8800, max_body_bytes=MAX_BODY_BYTES)


def service_token(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str | None:
    """The bearer token from the environment; without one the service does not start, unless ``--insecure``
    (then it says so loudly). Exits through ``parser.error`` (status 2) with the fix."""
    return CREDENTIAL.from_environment(parser, args)


def serve(service: RolloutService, token: str | None, args: argparse.Namespace) -> None:
    """Serve ``service`` until interrupted, bounded like the coordinator (see the module docstring)."""
    serving.serve(create_app(service, token, max_body_bytes=args.max_body_bytes), args, logger_name=logger.name)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", required=True, help="the model's tokenizer (a directory)")
    parser.add_argument("--vllm-url", required=True, help="vLLM's inference routes")
    parser.add_argument("--env-url", required=True, help="the environment (its bearer token: WORDLE_ENV_TOKEN)")
    parser.add_argument(
        "--insecure-http",
        action="store_true",
        help="send WORDLE_ENV_TOKEN to a plain http:// environment on another host, in clear (default: refused)",
    )
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--prompts-per-step", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=12)
    parser.add_argument("--max-staleness", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2, help="groups generated at a time")
    parser.add_argument("--positions", type=int, default=160, help="game positions to play from")
    parser.add_argument("--seed", type=int, default=0)
    add_service_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[rollouts] %(asctime)s %(message)s", stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    token = service_token(parser, args)  # before anything is loaded: a service without a credential never starts

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    env = env_client(args.env_url, insecure_http=args.insecure_http)
    vllm = httpx.Client(base_url=args.vllm_url, timeout=300)
    make_group, positions, probe = wordle_producer(
        vllm, env, tok, positions=args.positions, seed=args.seed, n=args.num_generations, max_tokens=args.max_tokens
    )
    service = RolloutService(
        make_group,
        positions,
        workers=args.workers,
        max_staleness=args.max_staleness,
        per_step=args.prompts_per_step,
        probe=probe,
    )
    try:
        serve(service, token, args)
    finally:
        service.stop()


if __name__ == "__main__":
    main()
