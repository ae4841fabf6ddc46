"""The Wordle rollout service (examples/wordle/rollout_server.py) as an adversary on the trainer's network would
use it: only the token holder takes groups, no group beyond the staleness bound is handed out, malformed requests
get a 4xx and leave the service working, a failing worker is a 500 with its reason, and production never stops
in silence."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from examples.wordle.rollout_server import RolloutService, create_app
from examples.wordle.rollouts import Completion, Group, Positions, version_range

TOKEN = "s3cret-s3cret-s3cret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
TAKE = {"trainer_version": 0, "count": 1, "timeout_s": 2.0}


def _group(first: int, last: int | None = None) -> Group:
    c = Completion([1], [-1.0], 0.0, first, first if last is None else last)
    return Group([1, 2], [c], time.time())


@pytest.fixture
def make_service() -> Iterator[Callable[..., RolloutService]]:
    made: list[RolloutService] = []

    def make(group: Callable[[list[int], str, int], Group] = lambda p, s, i: _group(0), **kw: Any) -> RolloutService:
        kw = {"workers": 1, "max_staleness": 0, "per_step": 1} | kw
        service = RolloutService(group, Positions([([1, 2], "s")], seed=0), **kw)
        made.append(service)
        return service

    yield make
    for service in made:
        service.stop()


def _client(service: RolloutService, token: str | None = TOKEN) -> TestClient:
    return TestClient(create_app(service, token), raise_server_exceptions=False)


@pytest.mark.parametrize(
    "header", [None, TOKEN, "Bearer", "Bearer ", f"Bearer {TOKEN[:-1]}", f"Bearer {TOKEN}X", f"bearer {TOKEN}"]
)
def test_only_the_exact_bearer_token_takes_groups_or_reads_stats(make_service: Any, header: str | None) -> None:
    service = make_service()
    client = _client(service)
    headers = {} if header is None else {"Authorization": header}
    assert client.get("/v1/stats", headers=headers).status_code == 401
    assert client.post("/v1/take", json=TAKE, headers=headers).status_code == 401
    assert not service._started  # nothing generated for a refused caller
    assert client.post("/v1/take", json=TAKE, headers=AUTH).status_code == 200


@pytest.mark.parametrize("token", ["", "short"])
def test_an_empty_or_short_token_is_refused_at_start(make_service: Any, token: str) -> None:
    with pytest.raises(ValueError, match="at least 16"):
        create_app(make_service(), token)


@pytest.mark.parametrize(
    "body",
    [
        b'{"trainer_version": -1, "count": 1}',
        b'{"trainer_version": 0, "count": 0}',
        b'{"trainer_version": 0, "count": 1, "timeout_s": 61}',
        b'{"trainer_version": 0, "count": 1, "timeout_s": NaN}',
        b'{"trainer_version": 0, "count": 1, "timeout_s": Infinity}',
        b'{"trainer_version": 1e400, "count": 1}',
        b'{"trainer_version": "0", "count": true}',
        b'{"trainer_version": 0, "count": 1, "x": 1}',
        b"[]",
        b"",
    ],
)
def test_a_malformed_take_is_a_4xx_and_the_service_goes_on(make_service: Any, body: bytes) -> None:
    client = _client(make_service())
    r = client.post("/v1/take", content=body, headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 422, (r.status_code, r.text[:300])
    assert client.post("/v1/take", json=TAKE, headers=AUTH).status_code == 200


def test_a_trainer_taking_more_per_step_than_the_service_makes_is_told_so(make_service: Any) -> None:
    """Production is sized to --prompts-per-step groups a version: a trainer taking 8 from a service started
    with 2 waited forever without an error."""
    client = _client(make_service(per_step=2, max_staleness=2))
    r = client.post("/v1/take", json={"trainer_version": 0, "count": 8, "timeout_s": 1}, headers=AUTH)
    assert r.status_code == 422 and "--prompts-per-step 2" in r.text


def test_no_group_beyond_the_bound_is_handed_out_even_when_the_trainer_goes_back(make_service: Any) -> None:
    versions = itertools.cycle([0, 1, 2, 3, 4, 5])
    service = make_service(lambda p, s, i: _group(next(versions)), max_staleness=1, per_step=2, workers=2)
    client = _client(service)
    handed = 0
    for trainer in [5, 5, 2, 9, 3, 4]:
        body = {"trainer_version": trainer, "count": 2, "timeout_s": 0.5}
        groups = client.post("/v1/take", json=body, headers=AUTH).json()["groups"]
        handed += len(groups)
        assert all(trainer - min(c["first_version"] for c in g["completions"]) <= 1 for g in groups)
    assert handed > 0


def test_a_failing_worker_or_a_bad_group_is_a_500_with_its_reason(make_service: Any) -> None:
    def boom(p: list[int], s: str, i: int) -> Group:
        raise ConnectionError("vLLM is gone")

    r = _client(make_service(boom)).post("/v1/take", json=TAKE, headers=AUTH)
    assert r.status_code == 500 and "vLLM is gone" in r.text
    bad = make_service(lambda p, s, i: Group([1], [Completion([1], [0.0], 0.0, None, None)], 0.0))  # type: ignore[arg-type]
    r = _client(bad).post("/v1/take", json=TAKE, headers=AUTH)
    assert r.status_code == 500 and "TypeError" in r.text


def test_a_probe_that_cannot_say_does_not_stop_production(make_service: Any) -> None:
    """A probe that keeps answering None (vLLM unreachable for it) used to hold every producer back forever:
    the trainer got empty answers without end. Production now goes on one group at a time."""
    versions = itertools.count(3)
    service = make_service(lambda p, s, i: _group(next(versions)), max_staleness=2, per_step=1, probe=lambda: None)
    client = _client(service)
    got = 0
    for trainer in range(3, 8):
        got += len(client.post("/v1/take", json={**TAKE, "trainer_version": trainer}, headers=AUTH).json()["groups"])
    assert got >= 4


@pytest.mark.parametrize(("workers", "maxsize"), [(0, None), (1, 0)])
def test_zero_workers_or_room_is_refused(make_service: Any, workers: int, maxsize: int | None) -> None:
    with pytest.raises(ValueError, match="workers >= 1"):
        make_service(workers=workers, maxsize=maxsize)


def test_a_completion_spanning_a_rollback_is_as_old_as_its_oldest_token() -> None:
    spans = [{"version": "5", "start": 0, "end": 3}, {"version": "2", "start": 3, "end": 8}]
    assert version_range(spans) == (2, 5)
