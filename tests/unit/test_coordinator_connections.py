"""The coordinator's connection caps and their refusal log (slow clients cannot starve it). The protocol
that enforces them on real sockets is tested in tests/integration/test_slow_clients.py."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import pytest
from deltasync_coordinator.app import create_app
from deltasync_coordinator.connections import LOG_BURST, LOG_WINDOW_S, ConnectionLedger, fit_to_open_files
from deltasync_coordinator.settings import Settings
from pydantic import ValidationError

from deltasync._cli_run import add_coordinator_parser
from tests.support.asgi import PUB, make_settings, open_coordinator


def test_the_caps_stay_below_the_open_files_limit() -> None:
    assert fit_to_open_files(4096, 1024, 1 << 20) == (4096, 1024)
    assert fit_to_open_files(4096, 1024, 512) == (448, 416)  # 64 files kept; one address leaves 32 to others
    assert fit_to_open_files(4096, 100, 512) == (448, 100)
    assert fit_to_open_files(4096, 1024, 40) == (1, 1)


def test_refusals_name_the_cap_and_count(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="deltasync.coordinator")
    ledger = ConnectionLedger(max_connections=3, max_per_peer=2)
    assert ledger.admit("10.0.0.1") is None and ledger.admit("10.0.0.1") is None
    assert (
        ledger.admit("10.0.0.1")
        == "too many connections from 10.0.0.1 (2 open, max_connections_per_peer); retry after 1 s"
    )
    assert ledger.admit("10.0.0.2") is None
    assert ledger.admit("10.0.0.3") == "too many connections (3 open, max_connections); retry after 1 s"
    ledger.release("10.0.0.1")
    assert ledger.admit("10.0.0.3") is None  # a closed connection frees its place, overall and for its address
    assert ledger.open == 3 and ledger.refused == {"max_connections": 1, "max_connections_per_peer": 1}
    for peer in ("10.0.0.1", "10.0.0.2", "10.0.0.3"):
        ledger.release(peer)
    assert ledger.open == 0 and ledger._by_peer == {}
    assert caplog.messages == [
        "connection from 10.0.0.1 closed with 503: too many connections from 10.0.0.1 (2 open, "
        "max_connections_per_peer); retry after 1 s",
        "connection from 10.0.0.3 closed with 503: too many connections (3 open, max_connections); retry after 1 s",
    ]


def test_a_flood_costs_at_most_log_burst_lines_of_each_kind(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="deltasync.coordinator")
    ledger = ConnectionLedger(max_connections=0, max_per_peer=0)
    for _ in range(LOG_BURST + 5):
        ledger.admit("10.0.0.9")
        ledger.record_timeout("head", "10.0.0.8", 408, "request head not received within 10 s (request_head_timeout_s)")
    assert len(caplog.messages) == 2 * LOG_BURST
    assert ledger.refused["max_connections"] == ledger.timed_out["head"] == LOG_BURST + 5  # every one counted
    ledger._bursts["max_connections"].window_start -= LOG_WINDOW_S + 1  # the window is over
    ledger.admit("10.0.0.9")
    assert caplog.messages[-1].endswith("(0 open, max_connections); retry after 1 s; 5 more like this not logged")


def test_each_connection_setting_is_a_flag_of_deltasync_coordinator() -> None:
    parser = argparse.ArgumentParser()
    add_coordinator_parser(parser.add_subparsers())
    flags = "--max-connections 600 --max-connections-per-peer 50 --request-head-timeout-s 2 --request-body-timeout-s 4"
    args = parser.parse_args(["coordinator", *flags.split(), "--keep-alive-timeout-s", "1"])
    given = {k: v for k, v in vars(args).items() if k in Settings.model_fields and v is not None}
    assert given == {
        "max_connections": 600,
        "max_connections_per_peer": 50,
        "request_head_timeout_s": 2.0,
        "request_body_timeout_s": 4.0,
        "keep_alive_timeout_s": 1.0,
    }


def test_max_connections_leaves_room_for_the_long_polls(tmp_path: Path) -> None:
    with pytest.raises(
        ValidationError, match=r"max_connections \(512\) must exceed max_long_polls \(512\) by at least 32"
    ):
        Settings(db=tmp_path / "c.db", insecure=True, max_connections=512)
    assert Settings(db=tmp_path / "c.db", insecure=True, max_connections=544).max_connections == 544


@pytest.mark.anyio
async def test_metrics_show_open_refused_and_timed_out_connections(tmp_path: Path) -> None:
    app, http = await open_coordinator(make_settings(tmp_path))
    async with http:
        app.state.connections.admit("10.0.0.1")
        app.state.connections.record_timeout("body", "10.0.0.1", 408, "request body not received")
        text = (await http.get("/metrics", headers=PUB)).text
    app.state.db.close()
    assert "deltasync_connections_open 1.0" in text
    assert 'deltasync_connections_refused_total{reason="max_connections"} 0.0' in text
    assert 'deltasync_connections_refused_total{reason="max_connections_per_peer"} 0.0' in text
    assert 'deltasync_requests_timed_out_total{phase="head"} 0.0' in text
    assert 'deltasync_requests_timed_out_total{phase="body"} 1.0' in text


def test_a_long_poll_cap_above_what_the_open_files_allow_is_warned_about(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="deltasync.coordinator")
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (600, hard))
    try:
        app = create_app(Settings(db=tmp_path / "c.db", insecure=True, max_long_polls=512))
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    app.state.db.close()
    assert (app.state.connections.max_connections, app.state.connections.max_per_peer) == (536, 504)
    assert "max_connections 4096 lowered to 536: the open-files limit is 600 (raise it with ulimit -n)" in caplog.text
    assert (
        "max_long_polls 512 leaves 24 of the 536 connections the open-files limit 600 allows to other requests: "
        "lower --max-long-polls or raise the open-files limit (ulimit -n)" in caplog.text
    )
