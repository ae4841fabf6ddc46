"""Scripted players against the real Wordle environment server (uvicorn on 127.0.0.1)."""

from __future__ import annotations

import random
from collections.abc import Iterator

import httpx
import pytest

from examples.wordle.env_server import create_app
from examples.wordle.game import allowed_words
from examples.wordle.solver import TreeSolver
from tests.conftest import ServerThread


@pytest.fixture(scope="module")
def env() -> Iterator[httpx.Client]:
    with ServerThread(create_app()) as server, httpx.Client(base_url=server.url, timeout=30) as client:
        yield client


def play(env: httpx.Client, seed: int, choose) -> dict:
    obs = env.post("/v1/sessions", json={"seed": seed}).json()
    history: list[tuple[str, str]] = []
    while not obs["done"]:
        step = env.post(f"/v1/sessions/{obs['session_id']}/guess", json={"guess": choose(history)}).json()
        if step["valid"]:
            history.append((step["history"][-1]["guess"], step["feedback"]))
        obs = step
    return obs


def test_the_solver_always_wins_within_six(env: httpx.Client) -> None:
    solver = TreeSolver()
    for seed in range(150):
        result = play(env, seed, solver.guess)
        assert result["won"] and len(result["history"]) <= 6, result


def test_a_random_guesser_plays_whole_episodes(env: httpx.Client) -> None:
    rng = random.Random(0)
    words = sorted(allowed_words())
    outcomes = [play(env, 1000 + i, lambda h: rng.choice(words)) for i in range(40)]
    assert all(o["done"] and len(o["history"]) == 6 or o["won"] for o in outcomes)
    assert sum(o["won"] for o in outcomes) < 5


@pytest.mark.parametrize("move", ["", "héllo", "🙂🙂🙂🙂🙂", "cranes", "x" * 4096, "12345", "   "])
def test_hostile_input_warns_once_then_ends(env: httpx.Client, move: str) -> None:
    sid = env.post("/v1/sessions", json={"seed": 7}).json()["session_id"]
    first = env.post(f"/v1/sessions/{sid}/guess", json={"guess": move}).json()
    assert (first["valid"], first["reward"], first["done"], first["warnings"]) == (False, 0.0, False, 1)
    assert first["guesses_left"] == 6 and first["reason"]
    second = env.post(f"/v1/sessions/{sid}/guess", json={"guess": move}).json()
    assert second["done"] and not second["won"] and second["reward"] == 0.0
    assert env.post(f"/v1/sessions/{sid}/guess", json={"guess": "crane"}).status_code == 409


def test_oversized_and_malformed_requests_are_refused(env: httpx.Client) -> None:
    sid = env.post("/v1/sessions", json={"seed": 1}).json()["session_id"]
    assert env.post(f"/v1/sessions/{sid}/guess", json={"guess": "x" * 10_240}).status_code == 422
    assert env.post(f"/v1/sessions/{sid}/guess", json={"word": "crane"}).status_code == 422
    assert env.post("/v1/sessions/not-a-session/guess", json={"guess": "crane"}).status_code == 422
    assert env.post(f"/v1/sessions/{'0' * 32}/guess", json={"guess": "crane"}).status_code == 404
    assert env.post("/v1/sessions", json={"opening": ["qqqqq"]}).status_code == 422


def test_fork_copies_the_state(env: httpx.Client) -> None:
    obs = env.post("/v1/sessions", json={"seed": 3, "opening": ["crane", "slate"]}).json()
    assert [h["guess"] for h in obs["history"]] == ["crane", "slate"]
    fork = env.post(f"/v1/sessions/{obs['session_id']}/fork").json()
    assert fork["session_id"] != obs["session_id"] and fork["history"] == obs["history"]
    env.post(f"/v1/sessions/{fork['session_id']}/guess", json={"guess": "pious"})
    assert len(env.get(f"/v1/sessions/{obs['session_id']}").json()["history"]) == 2  # the original is untouched
    assert env.delete(f"/v1/sessions/{fork['session_id']}").status_code == 204
