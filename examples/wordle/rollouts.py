"""Rollouts for the Wordle trainer: groups of completions from the vLLM server, each tagged by the server with the
weight versions that produced it, a bounded queue with a staleness bound, and a watcher of what vLLM serves.

* :func:`generate_group` asks vLLM's token-in/token-out route (``POST /inference/v1/generate``, served with
  ``--enable-scale-out``) for ``n`` completions of one prompt. Each choice carries ``weight_versions``: the spans
  of output tokens sampled by each weight label. The deltasync agent sets that label to the version it applied, so
  the tag comes from the server, not from what the trainer assumes it published.
* With the sidecar's default pause mode ``keep``, a request in flight during an update is frozen and resumes on
  the new weights, so one completion can span two versions: a :class:`Completion` keeps the first and the last.
  The staleness of a group is judged by its *oldest* token.
* :class:`RolloutQueue` drops groups whose oldest token is more than ``max_staleness`` versions behind the
  trainer, and counts them; the trainer blocks only when nothing fresh enough is queued.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx

from deltasync.targets import parse_weight_version

from .game import allowed_words, parse_guess

__all__ = ["Completion", "Group", "RolloutQueue", "RolloutWorkers", "ServedVersions", "generate_group"]

logger = logging.getLogger("wordle.rollouts")
FORMAT_BONUS = 0.1


class Unlabelled(RuntimeError):
    """vLLM returned tokens without a numbered weight version (its start-up weights, or an unhealthy engine)."""


@dataclass(frozen=True, slots=True)
class Completion:
    """One sampled reply."""

    token_ids: list[int]
    logprobs: list[float]
    """vLLM's log-probability of each sampled token (the behaviour policy)."""
    reward: float
    first_version: int
    """Weight version of the first token, from the server's ``weight_versions``."""
    last_version: int
    """Weight version of the last token (differs when an update happened mid-request)."""


@dataclass(frozen=True, slots=True)
class Group:
    """``n`` completions of one prompt: the unit GRPO normalizes rewards over."""

    prompt_ids: list[int]
    completions: list[Completion]
    finished_at: float

    @property
    def oldest_version(self) -> int:
        return min(c.first_version for c in self.completions)

    @property
    def newest_version(self) -> int:
        return max(c.last_version for c in self.completions)

    @property
    def spans_update(self) -> bool:
        return any(c.first_version != c.last_version for c in self.completions)


def version_range(spans: list[dict[str, Any]] | None) -> tuple[int, int]:
    """(first, last) version of a choice's ``weight_versions`` spans; :class:`Unlabelled` if any is not a version."""
    if not spans:
        raise Unlabelled(f"vLLM returned no weight_versions ({spans!r}): is it started with --enable-scale-out?")
    versions = [parse_weight_version(s["version"]) for s in spans]
    if any(v is None for v in versions):
        raise Unlabelled(f"tokens sampled by weights labelled {[s['version'] for s in spans]}, not a version")
    return versions[0], versions[-1]  # type: ignore[return-value]


def score(env: httpx.Client, session_id: str, text: str) -> float:
    """The environment's reward for this reply as the next move (on a fork of the game), plus a format bonus."""
    guess = parse_guess(text)
    if guess is None or guess not in allowed_words():
        return 0.0
    fork = env.post(f"/v1/sessions/{session_id}/fork").json()["session_id"]
    step = env.post(f"/v1/sessions/{fork}/guess", json={"guess": guess}).json()
    env.delete(f"/v1/sessions/{fork}")
    return float(step["reward"]) + FORMAT_BONUS if step["valid"] else 0.0


def generate_group(
    vllm: httpx.Client,
    env: httpx.Client,
    tok: Any,
    prompt_ids: list[int],
    session_id: str,
    *,
    n: int,
    max_tokens: int,
    seed: int,
) -> Group:
    """``n`` completions of one prompt from vLLM, scored by the environment."""
    body = {
        "token_ids": prompt_ids,
        "sampling_params": {
            "n": n,
            "max_tokens": max_tokens,
            "temperature": 1.0,
            "logprobs": 0,
            "seed": seed,
            "stop_token_ids": [tok.eos_token_id],
        },
    }
    response = vllm.post("/inference/v1/generate", json=body)
    response.raise_for_status()
    completions = []
    for choice in sorted(response.json()["choices"], key=lambda c: c["index"]):
        first, last = version_range(choice.get("weight_versions"))
        ids = choice["token_ids"]
        logprobs = [t["logprob"] for t in choice["logprobs"]["content"]]
        if len(logprobs) != len(ids):
            raise RuntimeError(f"vLLM returned {len(logprobs)} logprobs for {len(ids)} tokens")
        text = tok.decode(ids, skip_special_tokens=True)
        completions.append(Completion(ids, logprobs, score(env, session_id, text), first, last))
    return Group(prompt_ids, completions, time.time())


class RolloutQueue:
    """A bounded queue of groups with a staleness bound at consumption.

    Args:
        maxsize: groups queued at most; producers block when it is full.
        max_staleness: a group whose oldest token is more than this many versions behind the trainer is dropped.
    """

    def __init__(self, maxsize: int, max_staleness: int) -> None:
        self._q: queue.Queue[Group] = queue.Queue(maxsize)
        self.max_staleness = max_staleness
        self.dropped = 0
        self.staleness: Counter[int] = Counter()
        """Versions behind at consumption, for every group the trainer took."""

    def put(self, group: Group, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                self._q.put(group, timeout=0.1)
                return
            except queue.Full:
                continue

    def take(self, trainer_version: int, check: Callable[[], None]) -> tuple[Group, float]:
        """The next group within the bound, and the seconds spent waiting for one (stale ones are dropped)."""
        waited = 0.0
        while True:
            try:
                group = self._q.get_nowait()
            except queue.Empty:
                t0 = time.perf_counter()
                while True:
                    check()
                    try:
                        group = self._q.get(timeout=0.1)
                        break
                    except queue.Empty:
                        continue
                waited += time.perf_counter() - t0
            behind = trainer_version - group.oldest_version
            if behind > self.max_staleness:
                self.dropped += 1
                logger.info("dropped a group %d versions behind (bound %d)", behind, self.max_staleness)
                continue
            self.staleness[behind] += 1
            return group, waited


class Positions:
    """Game positions to play from, handed out in a seeded random order, forever."""

    def __init__(self, rows: list[tuple[list[int], str]], seed: int) -> None:
        self.rows, self._rng, self._lock = rows, random.Random(seed), threading.Lock()
        self._order: list[int] = []
        self.count = 0

    def next(self) -> tuple[list[int], str, int]:
        with self._lock:
            if not self._order:
                self._order = list(range(len(self.rows)))
                self._rng.shuffle(self._order)
            self.count += 1
            return (*self.rows[self._order.pop()], self.count)


class RolloutWorkers:
    """Threads that generate groups continuously into a :class:`RolloutQueue` (the asynchronous mode), or on
    demand (:meth:`generate`, the lock-step mode). A worker's failure is raised in the trainer by :meth:`check`."""

    def __init__(
        self, make_group: Callable[[list[int], str, int], Group], positions: Positions, *, workers: int
    ) -> None:
        self.make_group, self.positions, self.workers = make_group, positions, workers
        self.stop_event = threading.Event()
        self.threads: list[threading.Thread] = []
        self.error: BaseException | None = None
        self.episodes = 0
        self._lock = threading.Lock()

    def _one(self) -> Group:
        group = self.make_group(*self.positions.next())
        with self._lock:
            self.episodes += len(group.completions)
        return group

    def start(self, into: RolloutQueue) -> None:
        def loop() -> None:
            try:
                while not self.stop_event.is_set():
                    into.put(self._one(), self.stop_event)
            except BaseException as exc:  # noqa: BLE001 (reported to the trainer by check())
                if not self.stop_event.is_set():
                    self.error = exc

        self.threads = [threading.Thread(target=loop, name=f"rollout-{i}", daemon=True) for i in range(self.workers)]
        for t in self.threads:
            t.start()

    def generate(self, groups: int) -> list[Group]:
        """``groups`` groups now, ``workers`` requests at a time (the lock-step mode)."""
        with ThreadPoolExecutor(self.workers, thread_name_prefix="rollout") as pool:
            return list(pool.map(lambda _: self._one(), range(groups)))

    def check(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"a rollout worker failed: {self.error!r}") from self.error

    def stop(self) -> None:
        self.stop_event.set()
        for t in self.threads:
            t.join(timeout=60)


class ServedVersions:
    """Polls vLLM's ``/weight_info`` and records when each version was first served (and waits for one).

    ``/weight_info`` is an administrative route: this measurement needs the engine credential
    (``DELTASYNC_ENGINE_TOKEN``, the operator's); the rollout workers never send it."""

    def __init__(self, vllm_url: str, interval_s: float = 0.02) -> None:
        from deltasync.vllm.guard import ENGINE_TOKEN_HEADER, load_engine_token

        token = load_engine_token()
        headers = {} if token is None else {ENGINE_TOKEN_HEADER: token}
        self._http = httpx.Client(base_url=vllm_url, timeout=30, headers=headers)
        self.interval_s = interval_s
        self.first_seen: dict[int, float] = {}
        self.current: int | None = None
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="served-versions", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                label = self._http.get("/weight_info").json()["weight_version"]
            except (httpx.HTTPError, KeyError, ValueError):
                label = None
            version = parse_weight_version(label)
            now = time.time()
            with self._cond:
                if version is not None and version != self.current:
                    self.current = version
                    self.first_seen.setdefault(version, now)
                    self._cond.notify_all()
            self._stop.wait(self.interval_s)

    def label(self) -> str:
        """vLLM's ``weight_version`` now."""
        return str(self._http.get("/weight_info").json()["weight_version"])

    def wait_for(self, version: int, timeout_s: float = 300) -> float:
        """Seconds until vLLM serves ``version`` or later."""
        t0 = time.perf_counter()
        with self._cond:
            while self.current is None or self.current < version:
                if time.perf_counter() - t0 > timeout_s:
                    raise TimeoutError(f"vLLM did not serve v{version} within {timeout_s} s (serves {self.current})")
                self._cond.wait(0.1)
        return time.perf_counter() - t0

    def served_at(self, version: int) -> float | None:
        """When vLLM first served ``version`` or a later one (an agent may apply several versions in one pause)."""
        times = [t for v, t in self.first_seen.items() if v >= version]
        return min(times) if times else None

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._http.close()
