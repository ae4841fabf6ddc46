"""The Wordle environment as its own service (the "env host"): sessions, guesses, feedback, rewards.

    python -m examples.wordle.env_server --port 8700      # or: uvicorn examples.wordle.env_server:create_app --factory

Invalid guesses are handled as TextArena-style games do: the first gets a warning (no guess is used), the second
ends the episode (lost). Sessions live in memory, capped in number and idle time.
"""

from __future__ import annotations

import argparse
import random
import threading
import time
import uuid
from typing import Annotated

from fastapi import FastAPI, HTTPException, Path
from pydantic import BaseModel, ConfigDict, Field

from .game import Game, answer_words

__all__ = ["create_app"]

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


def create_app() -> FastAPI:
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

    return app


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8700)
    args = parser.parse_args()
    uvicorn.run(create_app(), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
