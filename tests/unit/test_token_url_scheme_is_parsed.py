"""Whether a token would travel in clear is decided from the URL as parsed: ``HTTP://`` and ``Http://`` are plain
HTTP as ``http://`` is (httpx accepts a scheme in any case). The Wordle trainer's client of the rollout service
(``RemoteRollouts``, ``train.py --rollouts-url``) shares the coordinator clients' rule.

The other host is ``0.0.0.0``: not loopback by deltasync's rule, and Linux connects it to a listener here, which
records every byte it receives (what an eavesdropper on the path would read).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from deltasync._client_transport import refuse_token_in_clear
from examples.wordle.rollouts import RemoteRollouts
from tests.support.recording_server import RecordingServer

TOKEN = "rollout-token-0123456789abcdef"


@pytest.fixture
def listener() -> Iterator[RecordingServer]:
    """A server on 0.0.0.0 that records what it receives and answers nothing."""
    with RecordingServer(host="0.0.0.0") as server:
        yield server


@pytest.mark.parametrize("scheme", ["HTTP", "Http", "http"])
def test_the_rollout_client_refuses_plain_http_in_any_case_of_the_scheme(
    listener: RecordingServer, scheme: str
) -> None:
    url = f"{scheme}://0.0.0.0:{listener.port}"
    with pytest.raises(ValueError) as refused:
        RemoteRollouts(url, TOKEN)
    assert str(refused.value) == (
        f"rollout service {url} is plain http:// on another host: the bearer token would travel in clear; use "
        "https:// (with --ca-bundle), or accept the risk with --insecure-http"
    )
    assert not listener.received


def test_with_insecure_http_the_token_goes_and_the_listener_reads_it(
    listener: RecordingServer, caplog: pytest.LogCaptureFixture
) -> None:
    url = f"HTTP://0.0.0.0:{listener.port}"
    rollouts = RemoteRollouts(url, TOKEN, insecure_http=True)
    try:
        with pytest.raises(Exception):  # noqa: B017 - the listener is no rollout service: any failure will do
            rollouts.take(0, 1)
    finally:
        rollouts.stop()
    assert f"Bearer {TOKEN}".encode() in listener.received  # what the refusal above keeps off the wire
    assert f"rollout service {url} is plain http:// on another host: the bearer token travels in clear" in caplog.text


@pytest.mark.parametrize(
    ("url", "refused"),
    [
        ("HTTP://10.0.0.5:8600", True),
        ("hTTp://coordinator.example", True),
        ("HTTPS://10.0.0.5:8600", False),
        ("HTTP://127.0.0.1:8600", False),
        ("HTTP://[::1]:8600", False),
        ("HTTP://LOCALHOST:8600", False),
    ],
)
def test_the_shared_rule_parses_the_scheme_and_the_host(url: str, refused: bool) -> None:
    if refused:
        with pytest.raises(ValueError, match=r"^svc .* is plain http:// on another host"):
            refuse_token_in_clear(url, "svc", insecure_http=False, fix="do better")
    else:
        refuse_token_in_clear(url, "svc", insecure_http=False, fix="do better")
