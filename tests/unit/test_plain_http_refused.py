"""A bearer token never leaves for another host over plain ``http://`` unless the operator says so.

The client used to warn and send anyway, and took any host name that begins with ``127.`` for this machine:
``http://127.0.0.1.coordinator.example:8600`` is a DNS name that may point anywhere, and got no warning at all.
Now loopback is decided by parsing the host as an IP address (127.0.0.0/8, ``::1``) or the name ``localhost``;
anything else over ``http://`` with a token is refused before a byte is sent, unless ``insecure_http`` /
``--insecure-http``.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from deltasync._client_transport import is_loopback
from deltasync.cli import main
from deltasync.client import CoordinatorClient
from tests.conftest import PUBLISHER_TOKEN, agent_token
from tests.support.recording_server import RecordingServer

REFUSED = "is plain http:// on another host: the bearer token would travel in clear; use https://"


def _forbidden(request: bytes) -> bytes:
    body = b'{"detail":"a listener, not a coordinator"}'
    return f"HTTP/1.1 403 Forbidden\r\ncontent-length: {len(body)}\r\nconnection: close\r\n\r\n".encode() + body


@pytest.fixture
def listener() -> Iterator[RecordingServer]:
    """What an eavesdropper on the path reads: every byte that arrives."""
    with RecordingServer(_forbidden) as server:
        yield server


@pytest.mark.parametrize(
    "host",
    ["127.0.0.1.coordinator.example", "127.evil.example", "coordinator.example", "10.0.0.5", "0.0.0.0", "[::]"],
)
def test_a_token_to_another_host_over_plain_http_is_refused(host: str) -> None:
    url = f"http://{host}:8600"
    with pytest.raises(ValueError, match=REFUSED) as exc:
        CoordinatorClient(url, token=PUBLISHER_TOKEN)
    assert str(exc.value) == (
        f"coordinator {url} is plain http:// on another host: the bearer token would travel in clear; use https:// "
        "(with ca_bundle= / --ca-bundle), or accept the risk with insecure_http=True / --insecure-http"
    )


@pytest.mark.parametrize("host", ["127.0.0.1", "127.1.2.3", "localhost", "LOCALHOST", "[::1]", "[::ffff:127.0.0.1]"])
def test_loopback_over_plain_http_needs_no_flag(host: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="deltasync.client"):
        CoordinatorClient(f"http://{host}:8600", token=PUBLISHER_TOKEN).close()
    assert not caplog.records


def test_loopback_is_parsed_never_matched_by_prefix() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("127.255.0.9") and is_loopback("::1") and is_loopback("localhost")
    for name in ("127.0.0.1.coordinator.example", "127.0.0.1.", "localhost.example", "128.0.0.1", "0.0.0.0", "::"):
        assert not is_loopback(name), name


def test_insecure_http_sends_with_a_warning_and_no_token_needs_no_flag(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="deltasync.client"):
        CoordinatorClient("http://coordinator.example:8600").close()  # nothing secret to send
        assert not caplog.records
        CoordinatorClient("http://coordinator.example:8600", token=PUBLISHER_TOKEN, insecure_http=True).close()
    assert caplog.messages == [
        "coordinator http://coordinator.example:8600 is plain http:// on another host: the bearer token travels in "
        "clear (insecure_http)"
    ]


def test_the_cli_refuses_before_the_token_reaches_the_wire(
    listener: RecordingServer, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """From the network side: ``0.0.0.0`` is no loopback address, yet Linux connects it to this machine, where a
    listener records what arrives. Before, the token arrived in clear; now nothing arrives, and the CLI says
    why and what to do."""
    monkeypatch.setenv("DELTASYNC_PUBLISHER_TOKEN", PUBLISHER_TOKEN)
    url = f"http://0.0.0.0:{listener.port}"
    assert main(["gc", "--coordinator", url, "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert f"deltasync: error: coordinator {url} {REFUSED}" in err and "--insecure-http" in err
    assert PUBLISHER_TOKEN.encode() not in listener.received and not listener.received
    # the operator's explicit choice: sent (and refused by the listener, which is no coordinator)
    assert main(["gc", "--coordinator", url, "--dry-run", "--insecure-http"]) == 1
    assert f"Bearer {PUBLISHER_TOKEN}".encode() in listener.received


def test_the_agent_cli_refuses_a_plain_http_coordinator_on_another_host(tmp_path: Path) -> None:
    """A real ``deltasync agent`` process: it used to start and send its token to whatever the name resolves to
    (retrying for ever); now it stops at once, naming the URL and the fix."""
    url = "http://127.0.0.1.coordinator.example:8600"
    env = {**os.environ, "DELTASYNC_AGENT_TOKEN": agent_token("edge"), "DELTASYNC_ENGINE_TOKEN": "e" * 40}
    args = ["agent", "--vllm-url", "http://127.0.0.1:1", "--coordinator", url, "--store", str(tmp_path)]
    done = subprocess.run(
        [sys.executable, "-m", "deltasync.cli", *args], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2 and f"deltasync: error: coordinator {url} {REFUSED}" in done.stderr, done.stderr


def test_the_demo_trainer_never_sends_the_rollout_token_over_plain_http_to_another_host() -> None:
    """The Wordle trainer's client of the rollout service: the same rule as the coordinator's clients."""
    from examples.wordle.rollouts import RemoteRollouts

    with pytest.raises(ValueError, match="rollout service http://10.77.0.14:8700 is plain http:// on another host"):
        RemoteRollouts("http://10.77.0.14:8700", "rollout-token-0123456789")
    RemoteRollouts("http://127.0.0.1:8700", "rollout-token-0123456789").stop()
    RemoteRollouts("http://10.77.0.14:8700", "rollout-token-0123456789", insecure_http=True).stop()
