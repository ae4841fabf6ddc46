"""Processes for the fault suite that stop at a chosen point, so a test can kill -9 them exactly there.

python -m tests.integration.fault_scripts publish STORE COORD N --seed S --truth DIR [--pause-at KEY --marker F
    [--freeze-window-s S [--stop-after]]]
python -m tests.integration.fault_scripts agent VLLM COORD STORE STAGING --pause fetch|apply --marker F
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

import torch


def _pause(marker: str) -> None:
    Path(marker).write_text(str(os.getpid()))
    time.sleep(3600)  # the test kills us here


def publish(args: argparse.Namespace) -> None:
    from deltasync.client import CoordinatorClient, RetryPolicy
    from deltasync.config import PublisherConfig
    from deltasync.publisher import Publisher
    from deltasync.store import LocalStore
    from deltasync.testing.models import TINY_QWEN3_CONFIG, qwen3_shapes
    from deltasync.testing.stream import UpdateStream

    class PausingStore(LocalStore):
        def put(self, key: str, data: Any) -> None:
            if args.pause_at and args.pause_at in key:
                if args.freeze_window_s is None:
                    _pause(args.marker)
                # the test SIGSTOPs this process inside the window, past its lease refresh; once resumed it
                # writes the key, and with --stop-after pauses again there (for a kill -9)
                Path(args.marker).write_text(str(os.getpid()))
                time.sleep(args.freeze_window_s)
                super().put(key, data)
                if args.stop_after:
                    _pause(args.marker + ".written")
                return
            super().put(key, data)

    shapes = qwen3_shapes({**TINY_QWEN3_CONFIG, "vocab_size": 300, "hidden_size": 64, "intermediate_size": 96})
    stream = UpdateStream.from_shapes(shapes, seed=args.seed, lr=1e-5)
    client = CoordinatorClient(
        args.coordinator, token=os.environ["DELTASYNC_PUBLISHER_TOKEN"], retry=RetryPolicy(retries=40, backoff_s=0.05)
    )
    # a short lease: a restarted publisher takes the run over 3 s after this one is killed
    config = PublisherConfig(
        max_shard_bytes=8 << 10, anchor_every=None, anchor_bytes_fraction=None, lease_ttl_s=3, lease_wait_s=30
    )
    with Publisher(PausingStore(args.store), client, config) as pub:
        for step in range(args.n):
            weights = stream.step()
            version = pub.publish(weights, step)
            pub.flush()
            torch.save(weights, Path(args.truth) / f"v{version}.pt")


def agent(args: argparse.Namespace) -> None:
    from deltasync.agent import Agent
    from deltasync.client import CoordinatorClient
    from deltasync.config import AgentConfig
    from deltasync.staging import StagedUpdate
    from deltasync.store import LocalStore
    from deltasync.targets import HttpVllmTarget

    class PausingStore(LocalStore):
        def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
            if args.pause == "fetch" and "shard-" in key:
                _pause(args.marker)
            return super().get(key, max_bytes=max_bytes)

        def link_to(self, key: str, dst: Any, size: int) -> bool:  # a shard staged unread for an engine that decodes
            if args.pause == "fetch" and "shard-" in key:
                _pause(args.marker)
            return super().link_to(key, dst, size)

    class PausingTarget(HttpVllmTarget):
        def apply(self, update: StagedUpdate) -> None:
            if args.pause == "apply":  # inside the session: started and updated, never finished
                self._post("/start_weight_update")
                self._post("/update_weights", json={"update_info": update.to_update_info()})
                _pause(args.marker)
            super().apply(update)

    client = CoordinatorClient(args.coordinator, token=os.environ["DELTASYNC_AGENT_TOKEN"])
    config = AgentConfig(agent_id="sidecar-0", staging_dir=args.staging, poll_wait_s=1)
    Agent(store=PausingStore(args.store), coordinator=client, target=PausingTarget(args.vllm), config=config).run()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("publish")
    p.add_argument("store")
    p.add_argument("coordinator")
    p.add_argument("n", type=int)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--truth", required=True)
    p.add_argument("--pause-at")
    p.add_argument("--marker")
    p.add_argument("--freeze-window-s", type=float, help="at --pause-at: mark, sleep this long, then write the key")
    p.add_argument("--stop-after", action="store_true", help="with --freeze-window-s: pause after writing the key")
    a = sub.add_parser("agent")
    a.add_argument("vllm")
    a.add_argument("coordinator")
    a.add_argument("store")
    a.add_argument("staging")
    a.add_argument("--pause", choices=["fetch", "apply"], required=True)
    a.add_argument("--marker", required=True)
    ns = parser.parse_args()
    {"publish": publish, "agent": agent}[ns.cmd](ns)
