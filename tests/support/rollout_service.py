"""The Wordle rollout service as a real process for tests, with its production flags and bounds but a trivial
producer in place of vLLM and the environment (each group is one scripted completion):

    WORDLE_ROLLOUT_TOKEN=... python -m tests.support.rollout_service --port P [any rollout_server service flag]
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from examples.wordle.rollout_server import RolloutService, add_service_arguments, serve, service_token
from examples.wordle.rollouts import Completion, Group, Positions

__all__ = ["main"]


def _group(prompt_ids: list[int], session: str, index: int) -> Group:
    return Group([1, 2], [Completion([1], [-1.0], 0.0, 0, 0)], time.time())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    add_service_arguments(parser)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="[rollouts] %(asctime)s %(message)s", stream=sys.stderr)
    token = service_token(parser, args)
    service = RolloutService(_group, Positions([([1, 2], "s")], seed=0), workers=1, max_staleness=0, per_step=1)
    try:
        serve(service, token, args)
    finally:
        service.stop()


if __name__ == "__main__":
    main()
