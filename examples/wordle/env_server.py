"""The Wordle environment as its own service (the "env host"): sessions, guesses, feedback, rewards.

    WORDLE_ENV_TOKEN=... python -m examples.wordle.env_server --port 8700

Invalid guesses are handled as TextArena-style games do: the first gets a warning (no guess is used), the second
ends the episode (lost). Sessions live in memory, capped in number and idle time.

Every request but ``/healthz`` must carry ``WORDLE_ENV_TOKEN`` as a bearer token (the rollout workers and the
trainer send it: :func:`env_client`); without it the service refuses to start, unless ``--insecure``. It is
served as the coordinator is (:mod:`examples.wordle.serving`): a request without the token is refused from its
head, before any body byte is read; bodies are capped even with it; heads, bodies and TLS handshakes that do not
arrive in time are closed, and so are answers left unread and requests pipelined past a small depth; connections
are capped overall and per client address below the open-files limit.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Annotated

import httpx
from deltasync_coordinator.http import SizeLimits
from fastapi import FastAPI, HTTPException, Path
from pydantic import BaseModel, ConfigDict, Field

from . import serving
from .game import Game, answer_words
from .serving import MAX_HEADER_BYTES, Bearer, Credential

__all__ = ["CREDENTIAL", "MAX_BODY_BYTES", "TOKEN_ENV", "create_app", "env_client", "main"]

logger = logging.getLogger("wordle.env_server")
TOKEN_ENV = "WORDLE_ENV_TOKEN"
CREDENTIAL = Credential(
    env=TOKEN_ENV,
    service="the Wordle environment",
    sender="each rollout worker",
    may="play, read and fork its games",
    does="plays, reads and forks its games and fills its sessions",
)
MAX_BODY_BYTES = 16 << 10
"""A session's opening (at most 5 short guesses) or one guess (at most 4096 characters) is far smaller."""
MAX_SESSIONS = 100_000
IDLE_S = 3600.0
SESSION_ID = Annotated[str, Path(pattern=r"^[0-9a-f]{32}$")]


class SessionCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    seed: int | None = Field(None, description="picks the answer (random if omitted)")
    opening: list[Annotated[str, Field(max_length=64)]] = Field(
        default_factory=list, max_length=5, description="guesses played before the player"
    )


class GuessCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    guess: str = Field(max_length=4096, description="the raw move; anything else than an allowed word is invalid")


class Observation(BaseModel):
    session_id: str
    history: list[dict[str, str]]
    done: bool
    won: bool
    warnings: int
    guesses_left: int


class StepResult(Observation):
    valid: bool
    reason: str | None
    feedback: str | None
    reward: float


class _Sessions:
    def __init__(self) -> None:
        self._games: dict[str, tuple[Game, float]] = {}
        self._lock = threading.Lock()

    def add(self, game: Game) -> str:
        with self._lock:
            now = time.monotonic()
            if len(self._games) >= MAX_SESSIONS:  # evict idle sessions, then the oldest
                for sid in [s for s, (_, t) in self._games.items() if now - t > IDLE_S] or [next(iter(self._games))]:
                    del self._games[sid]
            sid = uuid.uuid4().hex
            self._games[sid] = (game, now)
            return sid

    def get(self, sid: str) -> Game:
        with self._lock:
            if sid not in self._games:
                raise HTTPException(404, f"session {sid} does not exist (or expired)")
            game, _ = self._games[sid]
            self._games[sid] = (game, time.monotonic())
            return game

    def drop(self, sid: str) -> None:
        with self._lock:
            if self._games.pop(sid, None) is None:
                raise HTTPException(404, f"session {sid} does not exist (or expired)")

    def __len__(self) -> int:
        return len(self._games)


def create_app(token: str | None = None, *, max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    """The environment's routes. ``token``: the bearer token every request but ``/healthz`` must carry, checked
    from the head before the body is read (``None``: none, for ``--insecure`` and in-process tests; an empty or
    short one is refused). Bodies over ``max_body_bytes`` get 413, with the token too. Serve it with
    :func:`main`'s bounds (:func:`examples.wordle.serving.serve`), not plain uvicorn."""
    if token is not None:
        CREDENTIAL.check(token)
    app = FastAPI(title="Wordle environment", version="1")
    sessions = _Sessions()

    def observe(sid: str, game: Game) -> Observation:
        return Observation(session_id=sid, **game.observation())  # type: ignore[arg-type]

    @app.get("/healthz")
    def healthz() -> dict[str, object]:
        return {"status": "ok", "sessions": len(sessions), "answers": len(answer_words())}

    @app.post("/v1/sessions", response_model=Observation, status_code=201)
    def create(body: SessionCreate) -> Observation:
        rng = random.Random(body.seed)
        game = Game(answer=rng.choice(answer_words()))
        for move in body.opening:
            if game.done:
                break
            result = game.play(move)
            if not result["valid"]:
                raise HTTPException(422, f"opening guess {move!r} is invalid: {result['reason']}")
        return observe(sessions.add(game), game)

    @app.get("/v1/sessions/{session_id}", response_model=Observation)
    def read(session_id: SESSION_ID) -> Observation:
        return observe(session_id, sessions.get(session_id))

    @app.post("/v1/sessions/{session_id}/fork", response_model=Observation, status_code=201)
    def fork(session_id: SESSION_ID) -> Observation:
        game = sessions.get(session_id)
        copy = Game(
            answer=game.answer, history=list(game.history), warnings=game.warnings, done=game.done, won=game.won
        )
        return observe(sessions.add(copy), copy)

    @app.post("/v1/sessions/{session_id}/guess", response_model=StepResult)
    def guess(session_id: SESSION_ID, body: GuessCreate) -> StepResult:
        game = sessions.get(session_id)
        if game.done:
            raise HTTPException(409, f"session {session_id} is over; start a new one")
        result = game.play(body.guess)
        return StepResult(session_id=session_id, **game.observation(), **result)  # type: ignore[arg-type]

    @app.delete("/v1/sessions/{session_id}", status_code=204)
    def delete(session_id: SESSION_ID) -> None:
        sessions.drop(session_id)

    app.add_middleware(SizeLimits, max_bytes=max_body_bytes, max_header_bytes=MAX_HEADER_BYTES, close=True)
    if token is not None:
        app.add_middleware(
            Bearer, token=token, credential=CREDENTIAL
        )  # outermost: nothing of a refused request is read
    return app


def env_client(url: str, *, insecure_http: bool = False, timeout_s: float = 60.0) -> httpx.Client:
    """A client of the environment at ``url`` that sends ``WORDLE_ENV_TOKEN`` (when set) as its bearer token.

    Raises:
        ValueError: with a token, ``url`` is plain ``http://`` on another host (the token would travel in clear),
            unless ``insecure_http``.
    """
    from deltasync._client_transport import refuse_token_in_clear

    token = os.environ.get(TOKEN_ENV) or None
    if token is not None:
        fix = "keep the environment on this host (as the demos do), or accept the risk with --insecure-http"
        refuse_token_in_clear(url, "the Wordle environment", insecure_http=insecure_http, fix=fix)
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    return httpx.Client(base_url=url, timeout=timeout_s, headers=headers)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    serving.add_service_arguments(parser, CREDENTIAL, port=8700, max_body_bytes=MAX_BODY_BYTES)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[env] %(asctime)s %(message)s", stream=sys.stderr)
    token = CREDENTIAL.from_environment(parser, args)
    serving.serve(create_app(token, max_body_bytes=args.max_body_bytes), args, logger_name=logger.name)


if __name__ == "__main__":
    main()
