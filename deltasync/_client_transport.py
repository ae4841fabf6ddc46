"""The coordinator client's transport: replicas, retries and failover, the run identity, and the one place where
HTTP errors become deltasync errors (:func:`_raise_for_status`).

:class:`~deltasync.client.CoordinatorClient` is this transport plus the typed API; its docstring says what is
retried, on which replica, and why that is safe.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import random
import time
from collections.abc import Sequence
from typing import Any, Self, TypeVar

import httpx
from pydantic import BaseModel, ValidationError

from .errors import CoordinatorError, RunMismatch
from .schemas import RUN_HEADER

__all__ = ["ClientTransport", "RetryPolicy", "is_loopback", "refuse_token_in_clear"]

# The client's logger: its retries, failovers and warnings are the client's (operators filter on this name).
logger = logging.getLogger("deltasync.client")

# Retry jitter from a private generator: never perturbs (or depends on) the process-wide `random` state.
_JITTER = random.Random()

_M = TypeVar("_M", bound=BaseModel)
_RETRY_STATUS = frozenset({500, 502, 503, 504})
_MAX_RETRY_AFTER_S = 30.0
_NEVER_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)
"""Transport errors before a request left this process: no replica can have carried it out."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RetryPolicy:
    """How a :class:`~deltasync.client.CoordinatorClient` waits for its replicas and retries a failed request.

    Example:
        >>> patient = RetryPolicy(timeout_s=60, retries=30)
        >>> client = CoordinatorClient(url, token=token, retry=patient)  # doctest: +SKIP
    """

    timeout_s: float = 30.0
    """Per-request timeout, on top of any long-poll wait: a replica that sends no bytes this long has failed."""
    retries: int = 8
    """Rounds after the first (a round tries every replica once), for retryable failures."""
    backoff_s: float = 0.2
    """First backoff; doubles each round, capped at 10 s (a ``Retry-After`` wins)."""

    def __post_init__(self) -> None:
        if self.retries < 0 or self.backoff_s < 0 or self.timeout_s <= 0:
            raise ValueError(
                f"need retries >= 0, backoff_s >= 0, timeout_s > 0; got {self.retries}, {self.backoff_s}, "
                f"{self.timeout_s}"
            )


def _error(response: httpx.Response, message: str) -> CoordinatorError:
    """A :class:`CoordinatorError` about ``response``: its status, its request's method and URL."""
    request = response.request
    return CoordinatorError(message, status_code=response.status_code, method=request.method, url=str(request.url))


def _raise_for_status(response: httpx.Response) -> None:
    """Turn an error response into :class:`CoordinatorError` (the one HTTP choke point)."""
    if response.is_success:
        return
    try:
        body = response.json()
    except ValueError:
        body = None
    detail = body.get("detail", response.text) if isinstance(body, dict) else response.text
    if isinstance(detail, list):  # FastAPI's 422: name each invalid field
        detail = "; ".join(
            f"{'.'.join(str(p) for p in d.get('loc', []))}: {d.get('msg')}" if isinstance(d, dict) else str(d)
            for d in detail
        )
    request = response.request
    raise _error(response, f"{request.method} {request.url.path}: {response.status_code} {detail}")


def _parse_urls(urls: str | Sequence[str]) -> tuple[str, ...]:
    """``"http://a:8600,http://b:8600"`` (the CLI's and the environment's form) or a list -> a tuple of URLs."""
    parts = urls.split(",") if isinstance(urls, str) else list(urls)
    out: list[str] = []
    for part in parts:
        url = part.strip().rstrip("/")
        if not url:
            continue
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"coordinator URL {url!r} must start with http:// or https://")
        if url in out:
            raise ValueError(f"coordinator URL {url} is listed twice in {urls!r}")
        out.append(url)
    if not out:
        raise ValueError(f"need at least one coordinator URL, got {urls!r}")
    schemes = {u.split("://", 1)[0] for u in out}
    if len(schemes) > 1:  # after a failover the token would go in clear to the http:// ones
        raise ValueError(
            f"coordinator URLs {urls!r} mix https:// and http://: a failover would send the token in clear; "
            "list replicas of one scheme"
        )
    return tuple(out)


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a URL's host) is this machine's loopback: an IP address in 127.0.0.0/8 or ``::1`` (an
    IPv4-mapped one too), or the name ``localhost``. Decided by parsing, never by prefix:
    ``127.0.0.1.coordinator.example`` is a name that any DNS may point anywhere."""
    name = host.strip("[]").lower()
    if name == "localhost":
        return True
    try:
        address = ipaddress.ip_address(name)
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


def refuse_token_in_clear(url: str, what: str, *, insecure_http: bool, fix: str) -> None:
    """A bearer token for ``url`` sent over plain HTTP to another host would travel in clear: refused, unless
    ``insecure_http`` (then said loudly). The scheme and the host are parsed (``HTTP://`` is plain HTTP too),
    never matched by prefix.

    Args:
        url: where the token would go.
        what: the service, first word of the message (``"coordinator"``).
        insecure_http: the operator accepts the risk.
        fix: what to do instead, the end of the message.

    Raises:
        ValueError: ``"{what} {url} is plain http:// on another host: the bearer token would travel in clear;
            {fix}"``.
    """
    parsed = httpx.URL(url)
    if parsed.scheme != "http" or is_loopback(parsed.host):
        return
    if not insecure_http:
        raise ValueError(
            f"{what} {url} is plain http:// on another host: the bearer token would travel in clear; {fix}"
        )
    logger.warning(
        "%s %s is plain http:// on another host: the bearer token travels in clear (insecure_http)", what, url
    )


def _refuse_if_clear(urls: tuple[str, ...], insecure_http: bool) -> None:
    """The coordinator's URLs, each by :func:`refuse_token_in_clear` (said loudly once per client)."""
    fix = "use https:// (with ca_bundle= / --ca-bundle), or accept the risk with insecure_http=True / --insecure-http"
    for url in urls:
        refuse_token_in_clear(url, "coordinator", insecure_http=insecure_http, fix=fix)


def _outcome(response: httpx.Response) -> str:
    """A failed answer in a few words, for the give-up message."""
    try:
        detail = response.json().get("detail", "")
    except (ValueError, AttributeError):
        detail = ""
    return f"{response.status_code} {detail}".strip()[:200]


class ClientTransport:
    """Requests to the coordinator's replicas, with retries, failover and the run identity pinned (see
    :class:`~deltasync.client.CoordinatorClient`, which documents the arguments). Safe to share between threads."""

    def __init__(
        self,
        base_url: str | Sequence[str],
        *,
        token: str | None = None,
        ca_bundle: str | None = None,
        insecure_http: bool = False,
        retry: RetryPolicy | None = None,
        run_id: str | None = None,
        http_client: httpx.Client | None = None,
    ) -> None:
        self.retry = retry or RetryPolicy()
        """The timeouts and the retry schedule."""
        self.urls: tuple[str, ...] = _parse_urls(base_url)
        """Every replica, in the order given."""
        if token:
            _refuse_if_clear(self.urls, insecure_http)
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        verify: Any = True
        if ca_bundle is not None:
            import ssl

            verify = ssl.create_default_context(cafile=ca_bundle)
        self._http = http_client or httpx.Client(timeout=self.retry.timeout_s, verify=verify)
        self._http.headers.update(headers)
        self._active = 0  # the replica that answered last (sticky); a plain int: races only reorder attempts
        self.run_id: str | None = run_id
        """The coordinator's run identity, pinned (from ``run_id`` or its first answer), for every replica."""

    @property
    def base_url(self) -> str:
        """The replica in use: the one that answered last (the first one given, before any answer)."""
        return self.urls[self._active]

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def pin_run(self, run_id: str) -> None:
        """Pin the run identity (an agent pins its engine's run); a coordinator of another run is refused.

        Raises:
            RunMismatch: another run is already pinned.
        """
        if self.run_id is not None and self.run_id != run_id:
            raise RunMismatch(
                f"{self.base_url}: this client follows run {self.run_id}, asked to pin run {run_id}",
                url=self.base_url,
            )
        self.run_id = run_id

    def _check_run(self, response: httpx.Response, base: str) -> None:
        """Pin or check the run (a RunMismatch carries no status code: callers branching on 404 must not see one)."""
        run = response.headers.get(RUN_HEADER)
        if run is None:
            # every deltasync answer names its run; a proxy's 502/503/504 may not (it is retried, never used)
            if self.run_id is not None and response.status_code not in _RETRY_STATUS:
                raise RunMismatch(
                    f"{response.request.method} {response.request.url.path}: the answer from {base} "
                    f"({response.status_code}) names no run ({RUN_HEADER} is missing), this client follows run "
                    f"{self.run_id}: not a deltasync coordinator, or a proxy that strips headers; refusing to "
                    "follow it",
                    method=response.request.method,
                    url=str(response.request.url),
                )
            return
        if self.run_id is None:
            self.run_id = run
        elif run != self.run_id:
            raise RunMismatch(
                f"{response.request.method} {response.request.url.path}: the coordinator at {base} keeps "
                f"run {run}, this client follows run {self.run_id}: another ledger (a new coordinator, or a wrong "
                "URL); refusing to follow it",
                method=response.request.method,
                url=str(response.request.url),
            )

    def _move_from(self, index: int) -> None:
        """Round robin: a replica that failed is not the first one tried by the next call."""
        if self._active == index:
            self._active = (index + 1) % len(self.urls)

    def _send(
        self,
        method: str,
        path: str,
        *,
        extra_timeout_s: float = 0,
        lost: list[str] | None = None,
        **kwargs: Any,
    ) -> httpx.Response:
        """One request with retries and failover; returns a 2xx response or raises CoordinatorError.

        ``lost`` collects, for a caller whose request is not idempotent, each URL whose attempt may have been
        carried out without an answer coming back (anything but a refused connection)."""
        timeout = httpx.Timeout(self.retry.timeout_s + extra_timeout_s)
        n = len(self.urls)
        last: dict[str, str] = {}  # what each replica answered last, for the give-up message
        response: httpx.Response | None = None
        error: httpx.TransportError | None = None
        tried = self.urls[self._active]
        for attempt in range(self.retry.retries + 1):
            retry_after: float | None = None
            start = self._active
            for step in range(n):
                index = (start + step) % n
                base = tried = self.urls[index]
                try:
                    response, error = self._http.request(method, base + path, timeout=timeout, **kwargs), None
                except httpx.TransportError as exc:
                    response, error = None, exc
                    last[base] = repr(exc)
                    if lost is not None and not isinstance(exc, _NEVER_SENT):
                        lost.append(f"{base}: {exc!r}")
                else:
                    try:
                        self._check_run(response, base)
                    except RunMismatch:
                        self._move_from(index)
                        raise
                    if response.status_code not in _RETRY_STATUS:
                        self._active = index  # sticky: the next call starts here
                        _raise_for_status(response)
                        return response
                    last[base] = _outcome(response)
                    if lost is not None:
                        lost.append(f"{base}: {last[base]}")
                    header = response.headers.get("Retry-After", "")
                    if header.isdigit():
                        retry_after = max(retry_after or 0.0, min(float(header), _MAX_RETRY_AFTER_S))
                self._move_from(index)
                if step < n - 1:
                    logger.warning(
                        "coordinator %s: %s %s failed (%s); failing over to %s",
                        base,
                        method,
                        path,
                        last[base],
                        self.urls[(index + 1) % n],
                    )
            if attempt >= self.retry.retries:
                break
            delay = min(self.retry.backoff_s * 2**attempt, 10.0) * (0.5 + _JITTER.random() / 2)
            if retry_after is not None:
                delay = max(delay, retry_after)
            logger.warning(
                "coordinator %s %s failed (%s); retry %d/%d in %.2f s",
                method,
                path,
                "; ".join(f"{u}: {r}" for u, r in last.items()) if n > 1 else last[self.urls[0]],
                attempt + 1,
                self.retry.retries,
                delay,
            )
            time.sleep(delay)
        rounds = self.retry.retries + 1
        if n == 1:  # one coordinator: the messages and status codes it always had
            if response is not None:
                _raise_for_status(response)
            raise CoordinatorError(
                f"{method} {path}: no answer from {self.urls[0]} in {rounds} attempts ({error!r})",
                method=method,
                url=f"{self.urls[0]}{path}",
            ) from error
        each = "; ".join(f"{u} answered {r}" if r[:1].isdigit() else f"{u}: {r}" for u, r in last.items())
        raise CoordinatorError(
            f"{method} {path}: no coordinator replica answered in {rounds} rounds over {n} replicas ({each})",
            status_code=None if response is None else response.status_code,
            method=method,
            url=f"{tried}{path}",
        ) from error

    @staticmethod
    def _parse(response: httpx.Response, model: type[_M]) -> _M:
        try:
            return model.model_validate_json(response.content)
        except ValidationError as exc:
            first = exc.errors()[0]
            raise _error(
                response,
                f"{response.request.method} {response.request.url.path}: the answer does not match the "
                f"protocol ({first['loc']}: {first['msg']}); is this a deltasync coordinator?",
            ) from None

    def _request(self, method: str, path: str, model: type[_M], **kwargs: Any) -> _M:
        return self._parse(self._send(method, path, **kwargs), model)
