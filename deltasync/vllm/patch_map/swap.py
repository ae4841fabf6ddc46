"""What one map build watches (the model, its parameters, the checkpoint's tensors and the loader), and a group
of parameters swapped for stand-ins while the loader writes into them."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from types import TracebackType
from typing import Any

import torch

from .as_found import restore_identity

__all__ = ["REPLACED", "Load", "Spec", "Subject", "Swap"]

Spec = Mapping[str, tuple[str, tuple[int, ...]]]
"""Checkpoint name -> (safetensors dtype name, shape)."""

Load = Callable[[Iterable[tuple[str, torch.Tensor]]], Any]
"""The model's ``load_weights``: checkpoint ``(name, tensor)`` pairs in, written into the live parameters."""

REPLACED = "the loader replaced a parameter object (re-registered it) or its data (param.data = ...)"


@dataclasses.dataclass(frozen=True)
class Subject:
    """The model whose map is built, its parameters by every name (tied ones under each), the checkpoint's tensors
    and the loader."""

    model: torch.nn.Module
    params: dict[str, torch.nn.Parameter]
    spec: Spec
    load: Load

    def load_into(self, swapped: Iterable[str], weights: list[tuple[str, torch.Tensor]]) -> bool:
        """``load(weights)`` while the parameters named in ``swapped`` hold stand-ins; whether the loader replaced
        a parameter object or a stand-in (:func:`restore_identity` puts both back). The loader's errors
        propagate."""
        stand_ins = {q: self.params[q].data for q in swapped}
        self.load(weights)
        return bool(restore_identity(self.model, self.params, stand_ins))


class Swap:
    """A group's parameters out of service while the loader writes into stand-ins: ``requires_grad`` off on entry
    (an integer stand-in cannot require gradients), and on exit, whatever happened, each parameter's own data and
    flag (as they were when this was made) put back. It may be entered again."""

    def __init__(self, subject: Subject, names: Iterable[str]) -> None:
        self.subject, self.names = subject, list(names)
        self.params = subject.params
        self.originals = {q: self.params[q].data for q in self.names}
        """The parameters' own data, by name (what the stand-ins are shaped after)."""
        self._grads = {q: self.params[q].requires_grad for q in self.names}

    def __enter__(self) -> Swap:
        for q in self.names:
            self.params[q].requires_grad_(False)
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        for q, data in self.originals.items():
            self.params[q].data = data
            self.params[q].requires_grad_(self._grads[q])

    def hold(self, stand_ins: Mapping[str, torch.Tensor]) -> None:
        """Put ``stand_ins`` (by parameter) in place of the parameters' data."""
        for q, t in stand_ins.items():
            self.params[q].data = t

    def data(self, q: str) -> torch.Tensor:
        """What parameter ``q`` holds now (its stand-in)."""
        return self.params[q].data

    def load(self, weights: list[tuple[str, torch.Tensor]]) -> bool:
        """:meth:`Subject.load_into` the swapped parameters."""
        return self.subject.load_into(self.names, weights)
