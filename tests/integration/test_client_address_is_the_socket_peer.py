"""The coordinator logs a client by its socket's address; ``X-Forwarded-For`` names nobody unless the operator
lists the proxies that may send it.

uvicorn believes ``X-Forwarded-For`` from 127.0.0.1 by default (its ``forwarded_allow_ips``), so a refusal sent
from loopback with ``X-Forwarded-For: 203.0.113.66`` was logged as from 203.0.113.66: a local process could put
any address in the coordinator's log. Now the header is ignored unless ``--trusted-proxies`` lists the socket's
peer, and then only the hop before the trusted proxies is taken.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import httpx
import pytest
from deltasync_coordinator.settings import Settings
from pydantic import ValidationError

from deltasync.testing.launchers import CoordinatorProcess
from tests.conftest import TOKENS_ENV


def _refused_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if '"GET /v1/versions HTTP/1.1" 401' in line]


def test_a_forwarded_for_header_from_loopback_names_nobody(tmp_path: Path) -> None:
    with CoordinatorProcess(tmp_path / "ledger.db", env=TOKENS_ENV) as proc:
        r = httpx.get(proc.url + "/v1/versions", headers={"X-Forwarded-For": "203.0.113.66"}, timeout=5)
        assert r.status_code == 401
        time.sleep(0.2)
    lines = _refused_lines(proc.log_path.read_text())
    assert len(lines) == 1 and " 127.0.0.1:" in lines[0] and "203.0.113.66" not in lines[0], lines


def test_behind_trusted_proxies_the_hop_before_them_is_logged(tmp_path: Path) -> None:
    args = ["--trusted-proxies", "127.0.0.1, 10.9.0.0/16"]
    with CoordinatorProcess(tmp_path / "ledger.db", env=TOKENS_ENV, args=args) as proc:
        # the client 198.51.100.7 reached a trusted proxy 10.9.0.5, which reached this one on loopback; what the
        # client wrote itself (left of the first untrusted hop) is never taken
        chain = "192.0.2.99, 198.51.100.7, 10.9.0.5"
        assert httpx.get(proc.url + "/v1/versions", headers={"X-Forwarded-For": chain}, timeout=5).status_code == 401
        time.sleep(0.2)
    lines = _refused_lines(proc.log_path.read_text())
    assert len(lines) == 1 and " 198.51.100.7:" in lines[0], lines


@pytest.mark.parametrize("value", ["*", "proxy.example", "10.0.0.300"])
def test_trusted_proxies_are_addresses_or_networks(value: str) -> None:
    with pytest.raises(ValidationError, match=re.escape(f"trusted proxy '{value}' is not an IP address or network")):
        Settings(trusted_proxies=f"10.0.0.1,{value}")
    assert Settings(trusted_proxies=" 10.0.0.1 , 10.1.0.0/16,::1").trusted_proxies == "10.0.0.1,10.1.0.0/16,::1"
