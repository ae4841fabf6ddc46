"""The engine's claim and label, each through its public methods (no vLLM started): one agent drives an engine,
another process with its id is refused while its session lives, a claim is given up only from its own session, and
a refused agent's claim goes only where it serves nothing; the label serves what a session staged unless a failure
unlabelled it meanwhile, and a version the engine knows is never relabelled."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from deltasync import LocalStore, write_anchor
from deltasync.apply import Holding
from deltasync.errors import RefusalReason
from deltasync.manifest import DeltaManifest

pytest.importorskip("vllm")

from deltasync.vllm.claim import Claim  # noqa: E402 - its messages are vLLM's dataclasses
from deltasync.vllm.label import Label  # noqa: E402
from deltasync.vllm.messages import DeltaSyncInitInfo  # noqa: E402


def _claim(agent: str, session: str, **more: object) -> DeltaSyncInitInfo:
    return DeltaSyncInitInfo(agent_id=agent, session=session, **more)  # type: ignore[arg-type]


def test_one_agent_drives_the_engine() -> None:
    claim, held = Claim(), Holding()
    assert claim.refusal(_claim("a", "s1", ttl_s=60.0, allow_rollback=True, staging_root="/stage"), held) is None
    claim.take(_claim("a", "s1", ttl_s=60.0, allow_rollback=True, staging_root="/stage"))
    assert (claim.owner, claim.allow_rollback, claim.staging_root, claim.ttl_s) == ("a", True, "/stage", 60.0)
    refusal = claim.refusal(_claim("b", "s9"), held)
    assert refusal is not None and "this engine is driven by agent 'a', agent 'b' may not take it" in refusal
    refusal = claim.refusal(_claim("a", "s2"), held)  # the same id, another process, while s1 lives
    assert refusal is not None and "drives this engine from another process" in refusal
    assert claim.refusal(_claim("a", "s1"), held) is None  # its own session claims again


def test_a_silent_session_gives_way_to_a_restarted_agent() -> None:
    claim = Claim()
    claim.take(_claim("a", "s1", ttl_s=0.05))
    claim.touch("s1")
    assert claim.alive_s() is not None
    time.sleep(0.1)
    assert claim.alive_s() is None
    assert claim.refusal(_claim("a", "s2"), Holding()) is None
    claim.touch("someone else's session")  # renews nothing
    assert claim.alive_s() is None


def test_a_claim_is_given_up_only_from_its_own_session() -> None:
    claim = Claim()
    claim.take(_claim("a", "s1"))
    assert not claim.release("a", "s2") and not claim.release("b", "s1")
    assert claim.owner == "a"
    assert claim.release("a", "s1") and claim.owner is None and claim.session is None


def test_a_refused_agent_loses_its_claim_only_where_the_engine_serves_nothing() -> None:
    claim = Claim()
    claim.take(_claim("a", "s1"))
    claim.release_unadmitted(RefusalReason.BASE, Holding())  # a gap: its agent catches up, keeps its claim
    claim.release_unadmitted(RefusalReason.MODEL, Holding(version=3))  # the engine serves v3: its agent stays
    assert claim.owner == "a"
    claim.release_unadmitted(RefusalReason.RUN, Holding())
    assert claim.owner is None


@pytest.fixture
def v5(tmp_path: Path) -> DeltaManifest:
    """A published anchor at v5."""
    return write_anchor(LocalStore(tmp_path), {"w": torch.ones(4, 4, dtype=torch.bfloat16)}, version=5)


def test_the_label_serves_what_the_session_staged(v5: DeltaManifest) -> None:
    label = Label()
    label.assume(4)
    assert (label.version, label.high_water) == (4, 4)
    label.assume(9)  # a known version is never relabelled
    assert label.version == 4
    label.stage(Holding(version=5, run_id="r", high_water=5), v5)
    assert label.version == 4  # served only once the session finishes
    held = label.serve_staged()
    assert held is not None and (label.version, label.run_id, label.high_water, label.healthy) == (5, "r", 5, True)
    assert label.manifest is not None and label.manifest.version == 5 and label.staged is None


def test_a_failure_during_the_session_leaves_nothing_to_serve(v5: DeltaManifest) -> None:
    """The failure rule: a drift or a failed write between the write and the session's end drops what was
    staged, and the engine stays unlabelled until an anchor restores it."""
    label = Label()
    label.assume(4)
    label.stage(Holding(version=5), v5)
    label.report_drift(["model.norm.weight"], by="this rank")
    assert label.serve_staged() is None
    assert (label.version, label.healthy, label.outcome["ok"]) == (None, False, False)
    assert label.drift is not None and label.drift["tensors"] == ["model.norm.weight"]
    assert "only an anchor restores this engine" in label.detail
    label.assume(4)  # an unhealthy engine is never relabelled by a claim
    assert label.version is None
