"""The one apply sequence (:func:`deltasync.apply.apply_update`): every object admitted before anything is read or
written; each read and checked, written, verified, in order; a failure after the first write unlabels the receiver,
one before it never does. Every receiver (the store reader, InMemoryTarget, the agent's host copy, the vLLM
engine's shadow, map and loader) goes through it with its own storage; here a receiver that records what it is
asked, over a real published run."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from deltasync import LocalStore, compute_delta, write_anchor, write_delta
from deltasync.apply import Holding, Receiver, Step, TensorsReceiver, apply_update
from deltasync.errors import IntegrityError, RefusalReason, UpdateRefused, VersionGapError
from deltasync.format import TensorDelta
from deltasync.manifest import DeltaManifest
from deltasync.reader import load_object, read_manifest
from deltasync.testing.stream import UpdateStream


class _Recording(TensorsReceiver):
    """A state dict that says what it was asked, and can be made to fail at one step."""

    def __init__(self, fail_at: tuple[str, int] | None = None) -> None:
        super().__init__()
        self.calls: list[tuple[str, int]] = []
        self.fail_at = fail_at
        self.unlabelled: list[Exception] = []

    def _step(self, what: str, manifest: DeltaManifest) -> None:
        self.calls.append((what, manifest.version))
        if self.fail_at == (what, manifest.version):
            raise RuntimeError(f"{what} v{manifest.version} failed")

    def check(self, objects: Sequence[tuple[DeltaManifest, Sequence[TensorDelta]]]) -> None:
        for m, _ in objects:
            self._step("check", m)

    def write(self, manifest: DeltaManifest, deltas: Sequence[TensorDelta]) -> None:
        self._step("write", manifest)
        super().write(manifest, deltas)

    def verify(self, manifest: DeltaManifest, deltas: Sequence[TensorDelta]) -> None:
        self._step("verify", manifest)
        super().verify(manifest, deltas)

    def unlabel(self, exc: Exception) -> None:
        self.unlabelled.append(exc)


@pytest.fixture
def run(tmp_path: Path) -> tuple[LocalStore, list[dict[str, torch.Tensor]]]:
    """An anchor v0 and deltas v1, v2."""
    store = LocalStore(tmp_path / "store")
    stream = UpdateStream.from_shapes({"w": (32, 16), "b": (32,)}, seed=9, lr=1e-3)
    states = [stream.bf16()]
    base = write_anchor(store, states[0], version=0)
    prev = {k: v.clone() for k, v in states[0].items()}
    for v in (1, 2):
        states.append(stream.step())
        base = write_delta(
            store, compute_delta(prev, states[v], update_prev=True), state=states[v], version=v, base=base
        )
    return store, states


def _steps(store: LocalStore, into: TensorsReceiver, chain: list[tuple[int, str]], reads: list[int]) -> list[Step]:
    def step(version: int, kind: str) -> Step:
        m = read_manifest(store, version, kind)  # type: ignore[arg-type]

        def read() -> list[TensorDelta]:
            reads.append(version)
            return load_object(store, m, base=into.tensors)

        return Step(m, f"{store.uri}/v{version}", read)

    return [step(v, k) for v, k in chain]


def test_each_object_is_read_checked_written_and_verified_in_order(run) -> None:
    store, states = run
    into, reads = _Recording(), []
    held = apply_update(_steps(store, into, [(0, "anchor"), (1, "delta"), (2, "delta")], reads), into, Holding())
    assert into.calls == [(s, v) for v in (0, 1, 2) for s in ("check", "write", "verify")]
    assert held is not None and held.version == 2 and held.high_water == 2
    assert all(torch.equal(into.tensors[n], states[2][n]) for n in states[2])  # type: ignore[index]
    assert into.unlabelled == []


def test_every_object_is_admitted_before_any_is_read_or_written(run) -> None:
    """A delta on another base in the middle of a session: nothing is read, nothing written, nothing unlabelled."""
    store, _ = run
    into, reads = _Recording(), []
    steps = _steps(store, into, [(0, "anchor"), (2, "delta")], reads)  # v2's base is v1, not v0
    with pytest.raises(VersionGapError) as caught:
        apply_update(steps, into, Holding())
    assert caught.value.reason is RefusalReason.BASE
    assert (reads, into.calls, into.unlabelled) == ([], [], [])


def test_a_failure_after_the_first_write_unlabels_the_receiver(run) -> None:
    store, _ = run
    for fail_at in (("write", 1), ("verify", 1), ("write", 0), ("verify", 0)):
        into = _Recording(fail_at=fail_at)
        steps = _steps(store, into, [(0, "anchor"), (1, "delta")], [])
        with pytest.raises(RuntimeError, match="failed"):
            apply_update(steps, into, Holding())
        assert len(into.unlabelled) == 1, fail_at


def test_a_failure_before_the_first_write_never_unlabels(run) -> None:
    """A refusal by the receiver's own check, or an object that cannot be read, read ahead of the first write."""
    store, _ = run
    into = _Recording(fail_at=("check", 1))  # each object read and checked right before it is written
    with pytest.raises(RuntimeError, match="check v1"):
        apply_update(_steps(store, into, [(0, "anchor"), (1, "delta")], []), into, Holding())
    assert into.calls[-1] == ("check", 1) and ("write", 1) not in into.calls
    assert len(into.unlabelled) == 1  # v0 was written: the receiver holds neither version now
    into = _Recording(fail_at=("check", 0))  # read ahead: the whole session checked before the first write
    with pytest.raises(RuntimeError, match="check v0"):
        apply_update(_steps(store, into, [(0, "anchor")], []), into, Holding(), read_ahead=True)
    assert into.calls == [("check", 0)] and into.unlabelled == []
    into = _Recording()
    steps = _steps(store, into, [(0, "anchor")], [])
    broken = Step(steps[0].manifest, "broken", lambda: (_ for _ in ()).throw(OSError("unreadable")))
    with pytest.raises(OSError, match="unreadable"):
        apply_update([steps[0], broken], into, read_ahead=True)
    assert into.calls == [] and into.unlabelled == []


def test_a_wrong_value_is_an_integrity_error_after_the_write_and_unlabels(run) -> None:
    """A delta whose entries decode but give other values than its checksums say: verify refuses it, after the
    write, so the receiver is unlabelled (it holds the wrong values)."""
    store, _ = run
    into = _Recording()
    steps = _steps(store, into, [(0, "anchor"), (1, "delta")], [])

    def wrong() -> list[TensorDelta]:
        deltas = steps[1].read()
        d = deltas[0]
        return [dataclasses.replace(d, values=d.values + 1), *deltas[1:]]

    with pytest.raises(IntegrityError, match="differ from the published checksums"):
        apply_update([steps[0], Step(steps[1].manifest, "v1", wrong)], into, Holding())
    assert len(into.unlabelled) == 1


def test_a_receiver_may_raise_its_own_error_when_unlabelled(run) -> None:
    """The vLLM engine and InMemoryTarget raise ApplyError after the first write: unlabel's error is the one
    the caller sees."""
    store, _ = run

    class Engine(Receiver):
        def write(self, manifest: DeltaManifest, deltas: Sequence[TensorDelta]) -> None:
            raise RuntimeError("the device went away")

        def verify(self, manifest: DeltaManifest, deltas: Sequence[TensorDelta]) -> None:
            raise AssertionError("never reached")

        def unlabel(self, exc: Exception) -> None:
            raise UpdateRefused(f"unlabelled: {exc}", reason=RefusalReason.UNHEALTHY) from exc

    m = read_manifest(store, 0, "anchor")
    with pytest.raises(UpdateRefused, match="unlabelled: the device went away"):
        apply_update([Step.of(m, load_object(store, m), "v0")], Engine())
