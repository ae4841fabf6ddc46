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

import collections
import dataclasses
import logging
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

from .game import allowed_words, parse_guess, render_messages
from .solver import TreeSolver

__all__ = [
    "Completion",
    "Group",
    "LocalRollouts",
    "RemoteRollouts",
    "RolloutQueue",
    "RolloutWorkers",
    "ServedVersions",
    "game_positions",
    "generate_group",
    "prompt_ids",
    "served_probe",
    "wordle_producer",
]

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
    """The oldest weight version among its tokens, from the server's ``weight_versions``."""
    last_version: int
    """The newest (differs when an update happened mid-request)."""


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

    def to_json(self) -> dict[str, Any]:
        return {
            "prompt_ids": self.prompt_ids,
            "completions": [dataclasses.asdict(c) for c in self.completions],
            "finished_at": self.finished_at,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Group:
        return cls(data["prompt_ids"], [Completion(**c) for c in data["completions"]], data["finished_at"])


def version_range(spans: list[dict[str, Any]] | None) -> tuple[int, int]:
    """(oldest, newest) version of a choice's ``weight_versions`` spans; :class:`Unlabelled` if any is not a
    version. The oldest, not the first: an engine rolled back during a request (``--allow-rollback``) sampled
    later tokens with older weights."""
    if not spans:
        raise Unlabelled(f"vLLM returned no weight_versions ({spans!r}): is it started with --enable-scale-out?")
    versions = [parse_weight_version(s["version"]) for s in spans]
    known = [v for v in versions if v is not None]
    if len(known) != len(versions):
        raise Unlabelled(f"tokens sampled by weights labelled {[s['version'] for s in spans]}, not a version")
    return min(known), max(known)


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
    model: str | None = None,
) -> Group:
    """``n`` completions of one prompt from vLLM (``model``: a LoRA adapter it serves), scored by the
    environment."""
    body: dict[str, Any] = {
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
    if model is not None:
        body["model"] = model
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


def prompt_ids(tok: Any, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of a chat prompt, ready for the reply."""
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids: list[int] = tok(text, add_special_tokens=False)["input_ids"]
    return ids


def game_positions(env: httpx.Client, tok: Any, n: int, seed: int) -> list[tuple[list[int], list[dict[str, str]], str]]:
    """Game positions from the environment (prompt ids, prompt messages, session id): a random answer and 0-2
    opening moves of the scripted solver."""
    rng, solver, rows = random.Random(seed), TreeSolver(), []
    for i in range(n):
        obs = env.post("/v1/sessions", json={"seed": seed * 100_000 + i}).json()
        for _ in range(rng.randint(0, 2)):
            history = [(h["guess"], h["feedback"]) for h in obs["history"]]
            obs = env.post(f"/v1/sessions/{obs['session_id']}/guess", json={"guess": solver.guess(history)}).json()
        if not obs["done"]:
            messages = render_messages([(h["guess"], h["feedback"]) for h in obs["history"]])
            rows.append((prompt_ids(tok, messages), messages, obs["session_id"]))
    return rows


def served_probe(vllm: httpx.Client, prompt_ids: list[int], model: str | None = None) -> int | None:
    """The version vLLM serves now, from the tag of a one-token answer on its inference route (no credential
    needed: the rollout workers' own view). ``None`` if it cannot say (not labelled with a version, unreachable)."""
    body: dict[str, Any] = {"token_ids": prompt_ids, "sampling_params": {"n": 1, "max_tokens": 1, "temperature": 0.0}}
    if model is not None:
        body["model"] = model
    try:
        response = vllm.post("/inference/v1/generate", json=body)
        response.raise_for_status()
        return version_range(response.json()["choices"][0].get("weight_versions"))[1]
    except (httpx.HTTPError, Unlabelled, KeyError, IndexError, ValueError):
        return None


class RolloutQueue:
    """A bounded queue of groups with a staleness bound at consumption, and production sized to consumption.

    A group is consumed ``(taken + queued) // per_step`` steps after it is queued (``taken``: the groups the trainer
    already took at its current version), and is then as stale as the trainer's
    version minus the version vLLM served when its first token was sampled. Generating it is waste if that will be
    beyond the bound, so a producer asks :meth:`reserve` before it starts a group (as AsyncGRPO counts its in-flight
    tasks): it waits while the queue and the groups in flight fill ``maxsize``, or while the group would be dropped
    by the time it is taken, judged by the newest version vLLM was seen serving: in a finished group, or from
    ``probe`` (a one-token request whose answer carries vLLM's weight version; see :func:`served_probe`). Without a
    probe, one group at a time is let through while it is not known, so the producers learn that vLLM caught up.

    Args:
        maxsize: groups queued or in flight at most.
        max_staleness: a group whose oldest token is more than this many versions behind the trainer is dropped.
        per_step: groups the trainer takes per step.
        probe: what vLLM serves now (a version, or ``None``: not known).
        probe_interval_s: the probe is asked at most this often.
    """

    def __init__(
        self,
        maxsize: int,
        max_staleness: int,
        per_step: int = 1,
        *,
        probe: Callable[[], int | None] | None = None,
        probe_interval_s: float = 0.1,
    ) -> None:
        if maxsize < 1 or max_staleness < 0 or per_step < 1:
            raise ValueError(
                f"need maxsize >= 1, max_staleness >= 0, per_step >= 1; got {maxsize}, {max_staleness}, {per_step}"
            )
        self._q: collections.deque[Group] = collections.deque()
        self._cond = threading.Condition()
        self.maxsize, self.max_staleness, self.per_step = maxsize, max_staleness, per_step
        self.in_flight = 0
        self._taken_at_version = 0  # groups taken at trainer_version (the step's first per_step)
        self.trainer_version: int | None = None
        """The trainer's version at its last :meth:`take` (``None`` before the first)."""
        self.served_version: int | None = None
        """The newest version seen in a finished group: what vLLM serves, as far as the producers know."""
        self.dropped = 0
        self.staleness: Counter[int] = Counter()
        """Versions behind at consumption, for every group the trainer took."""
        self.held_back_s = 0.0
        """Producer seconds spent waiting in :meth:`reserve` because the group would have been dropped."""
        self.probe, self.probe_interval_s = probe, probe_interval_s
        self._probed_at = float("-inf")
        self._probe_failed = False

    def _would_drop(self) -> bool | None:
        """Whether a group started now would be beyond the bound when taken; ``None``: not known (what vLLM
        serves, or the trainer's version, is not known yet)."""
        if self.trainer_version is None or self.served_version is None:
            return None
        ahead = self._taken_at_version + len(self._q) + self.in_flight
        consumed_at = self.trainer_version + ahead // self.per_step
        return consumed_at - self.served_version > self.max_staleness

    def set_trainer_version(self, version: int) -> None:
        """The trainer is at ``version`` (:meth:`take` says so too)."""
        with self._cond:
            if version != self.trainer_version:
                self.trainer_version, self._taken_at_version = version, 0
            self._cond.notify_all()

    def _saw_served(self, version: int | None) -> None:
        if version is not None:
            self.served_version = max(self.served_version or 0, version)
            self._cond.notify_all()

    def reserve(self, stop: threading.Event) -> bool:
        """Wait until one more group may be generated; ``False`` if ``stop`` is set first. Call :meth:`put` or
        :meth:`release` after a ``True``.

        While a group would be dropped (or it is not known), the queue asks its ``probe`` what vLLM serves, at most
        every ``probe_interval_s``; without a probe, one group at a time is let through to learn it."""
        t0 = time.perf_counter()
        while not stop.is_set():
            probe_now = False
            with self._cond:
                if len(self._q) + self.in_flight < self.maxsize:
                    drop = self._would_drop()
                    # not known (no probe, or it could not say): one group at a time, to learn it
                    blind = self.probe is None or self._probe_failed
                    if drop is False or (self.in_flight == 0 and blind):
                        self.in_flight += 1
                        return True
                    if self.probe is not None and time.monotonic() - self._probed_at >= self.probe_interval_s:
                        self._probed_at, probe_now = time.monotonic(), True
                    else:
                        self._cond.wait(0.05)
                    if drop:
                        self.held_back_s += time.perf_counter() - t0
                    t0 = time.perf_counter()
                else:
                    self._cond.wait(0.1)
                    t0 = time.perf_counter()
            if probe_now:
                assert self.probe is not None
                try:
                    version = self.probe()
                except Exception:  # noqa: BLE001 - a failing probe is one that cannot say
                    logger.exception("the served-version probe failed")
                    version = None
                with self._cond:
                    self._probe_failed = version is None
                    self._saw_served(version)
        return False

    def release(self) -> None:
        """A reserved group that will not come (its producer failed)."""
        with self._cond:
            self.in_flight -= 1
            self._cond.notify_all()

    def put(self, group: Group) -> None:
        """Queue a reserved group."""
        with self._cond:
            self.in_flight -= 1
            self._saw_served(group.newest_version)
            self._q.append(group)
            self._cond.notify_all()

    def take(
        self, trainer_version: int, check: Callable[[], None], timeout_s: float | None = None
    ) -> tuple[Group | None, float]:
        """The next group within the bound, and the seconds spent waiting for one (stale ones are dropped);
        ``None`` if ``timeout_s`` passed first."""
        waited, deadline = 0.0, None if timeout_s is None else time.monotonic() + timeout_s
        self.set_trainer_version(trainer_version)
        with self._cond:
            while True:
                if not self._q:
                    t0 = time.perf_counter()
                    while not self._q:
                        check()
                        if deadline is not None and time.monotonic() >= deadline:
                            return None, waited + time.perf_counter() - t0
                        self._cond.wait(0.1)
                    waited += time.perf_counter() - t0
                group = self._q.popleft()
                self._cond.notify_all()
                behind = trainer_version - group.oldest_version
                if behind > self.max_staleness:
                    self.dropped += 1
                    logger.info("dropped a group %d versions behind (bound %d)", behind, self.max_staleness)
                    continue
                self.staleness[behind] += 1
                self._taken_at_version += 1
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
                while into.reserve(self.stop_event):
                    try:
                        group = self._one()
                    except BaseException:
                        into.release()
                        raise
                    into.put(group)
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


def wordle_producer(
    vllm: httpx.Client,
    env: httpx.Client,
    tok: Any,
    *,
    positions: int,
    seed: int,
    n: int,
    max_tokens: int,
    model: str | None = None,
) -> tuple[Callable[[list[int], str, int], Group], Positions, Callable[[], int | None]]:
    """What rollout workers need, wherever they run: ``positions`` game positions from the environment, a group
    maker (``n`` completions of ``max_tokens`` from vLLM, scored by the environment; ``model``: the LoRA adapter
    that is the policy), and a probe of the version vLLM serves."""
    rows = game_positions(env, tok, positions, seed)

    def make_group(prompt: list[int], session_id: str, i: int) -> Group:
        return generate_group(
            vllm, env, tok, prompt, session_id, n=n, max_tokens=max_tokens, seed=seed + i, model=model
        )

    positions_ = Positions([(ids, sid) for ids, _, sid in rows], seed)
    return make_group, positions_, lambda: served_probe(vllm, rows[0][0], model)


class LocalRollouts:
    """Rollout workers in the trainer's process: asynchronous (threads generate into a :class:`RolloutQueue`
    sized to consumption, started by :meth:`start`) or lock-step (``sync``: each step's groups generated when the
    trainer asks, after vLLM serves its version)."""

    def __init__(
        self,
        make_group: Callable[[list[int], str, int], Group],
        positions: Positions,
        *,
        workers: int,
        max_staleness: int,
        per_step: int,
        sync: bool = False,
        maxsize: int | None = None,
        probe: Callable[[], int | None] | None = None,
    ) -> None:
        if workers < 1 or (maxsize is not None and maxsize < 1):
            raise ValueError(f"need workers >= 1 and maxsize >= 1 (or None), got {workers} and {maxsize}")
        self.sync = sync
        self.workers = RolloutWorkers(make_group, positions, workers=workers)
        bound = 0 if sync else max_staleness
        size = per_step * (bound + 1) if maxsize is None else maxsize
        self.queue = RolloutQueue(size, bound, per_step, probe=probe)

    def start(self, trainer_version: int) -> None:
        """Start the workers for a trainer at ``trainer_version`` (asynchronous mode; once: later calls only
        update the trainer's version)."""
        self.queue.set_trainer_version(trainer_version)
        if not self.sync and not self.workers.threads:
            self.workers.start(self.queue)

    def take(self, version: int, count: int) -> tuple[list[Group], float]:
        """The step's groups and the seconds the trainer waited for them: generated now (lock-step), or taken from
        the queue within the staleness bound (asynchronous)."""
        if self.sync:
            t0 = time.perf_counter()
            groups = self.workers.generate(count)
            for g in groups:
                self.queue.staleness[version - g.oldest_version] += 1
            return groups, time.perf_counter() - t0
        taken = [self.queue.take(version, self.workers.check) for _ in range(count)]
        return [g for g, _ in taken if g is not None], sum(waited for _, waited in taken)

    @property
    def dropped(self) -> int:
        return self.queue.dropped

    @property
    def episodes(self) -> int:
        return self.workers.episodes

    @property
    def held_back_s(self) -> float:
        return self.queue.held_back_s

    @property
    def staleness(self) -> Counter[int]:
        return self.queue.staleness

    def stop(self) -> None:
        self.workers.stop()


class RemoteRollouts:
    """The trainer's side of a rollout service on another host (:mod:`examples.wordle.rollout_server`): groups
    taken within the staleness bound, as from a local :class:`RolloutQueue`; its counters come with each answer.

    Args:
        url: the service's base URL (``https://`` across hosts: the token and the groups cross the network).
        token: its bearer token (``WORDLE_ROLLOUT_TOKEN``), or ``None``.
        ca_bundle: CA certificates (PEM) for an ``https://`` service (default: the system's).
        insecure_http: send the token over plain ``http://`` to another host anyway (refused otherwise: it would
            travel in clear).
    """

    def __init__(
        self, url: str, token: str | None = None, ca_bundle: str | None = None, *, insecure_http: bool = False
    ) -> None:
        import ssl

        from deltasync._client_transport import refuse_token_in_clear

        if token is not None:
            fix = "use https:// (with --ca-bundle), or accept the risk with --insecure-http"
            refuse_token_in_clear(url, "rollout service", insecure_http=insecure_http, fix=fix)
        headers = {} if token is None else {"Authorization": f"Bearer {token}"}
        verify: ssl.SSLContext | bool = ssl.create_default_context(cafile=ca_bundle) if ca_bundle else True
        self._http = httpx.Client(base_url=url, timeout=60, headers=headers, verify=verify)
        self.dropped = 0
        self.episodes = 0
        self.held_back_s = 0.0
        self.staleness: Counter[int] = Counter()

    def take(self, trainer_version: int, count: int) -> tuple[list[Group], float]:
        """``count`` groups within the bound for a trainer at ``trainer_version``, and the seconds waited."""
        groups: list[Group] = []
        waited = 0.0
        while len(groups) < count:
            body = {"trainer_version": trainer_version, "count": count - len(groups), "timeout_s": 20}
            response = self._http.post("/v1/take", json=body)
            if response.status_code != 200:
                raise RuntimeError(f"the rollout service answered {response.status_code}: {response.text[:500]}")
            data = response.json()
            groups += [Group.from_json(g) for g in data["groups"]]
            waited += data["waited_s"]
            self.dropped, self.episodes, self.held_back_s = data["dropped"], data["episodes"], data["held_back_s"]
            self.staleness = Counter({int(k): v for k, v in data["staleness"].items()})
        return groups, waited

    def start(self, trainer_version: int) -> None:
        """Nothing to start: the service starts its workers at the first take."""

    def stop(self) -> None:
        self._http.close()


class ServedVersions:
    """Polls what vLLM serves and records when each version was first served (and waits for one).

    Two sources: vLLM's ``/weight_info`` (:meth:`from_vllm`), an administrative route that needs the engine
    credential (``DELTASYNC_ENGINE_TOKEN``, the operator's; the rollout workers never send it), or the coordinator's
    record of what the engine's agent applied (:meth:`from_coordinator`), for a trainer on another host than vLLM
    that must not hold the engine credential; it lags the engine by the agent's report, a few ms."""

    def __init__(
        self, probe: Callable[[], int | None], interval_s: float = 0.02, close: Callable[[], None] = lambda: None
    ) -> None:
        self._probe, self._close = probe, close
        self.interval_s = interval_s
        self.first_seen: dict[int, float] = {}
        self.current: int | None = None
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="served-versions", daemon=True)
        self._thread.start()

    @classmethod
    def from_vllm(cls, vllm_url: str, interval_s: float = 0.02) -> ServedVersions:
        from deltasync.engine_credential import load_engine_token
        from deltasync.targets import EngineAuth

        token = load_engine_token()
        http = httpx.Client(base_url=vllm_url, timeout=30, auth=None if token is None else EngineAuth(token))

        def probe() -> int | None:
            try:
                return parse_weight_version(http.get("/weight_info").json()["weight_version"])
            except (httpx.HTTPError, KeyError, ValueError):
                return None

        return cls(probe, interval_s, http.close)

    @classmethod
    def from_coordinator(cls, coordinator: Any, agent_id: str, interval_s: float = 0.05) -> ServedVersions:
        """``coordinator``: a :class:`deltasync.client.CoordinatorClient`; ``agent_id``: the engine's agent."""
        from deltasync.errors import CoordinatorError

        def probe() -> int | None:
            try:
                applied = [a.applied_version for a in coordinator.agents() if a.agent_id == agent_id]
            except (httpx.HTTPError, CoordinatorError):
                return None
            return applied[0] if applied else None

        return cls(probe, interval_s)

    def _loop(self) -> None:
        while not self._stop.is_set():
            version = self._probe()
            now = time.time()
            with self._cond:
                if version is not None and version != self.current:
                    self.current = version
                    self.first_seen.setdefault(version, now)
                    self._cond.notify_all()
            self._stop.wait(self.interval_s)

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
        self._close()
