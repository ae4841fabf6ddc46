"""TRL and Hugging Face Trainer integrations: publish deltas instead of streaming weights to vLLM.

* :class:`DeltaSyncWeightTransfer` implements TRL 1.16's ``trl.experimental.async_grpo`` ``WeightTransferProtocol``:
  ``AsyncGRPOTrainer(..., weight_transfer=DeltaSyncWeightTransfer(publisher))``. The trainer hands it every weight
  (rank 0, full tensors); it publishes a version and returns. Agents pause their own engines, so ``pause`` and
  ``resume`` do not touch vLLM.
* :class:`DeltaSyncCallback` is a ``transformers.TrainerCallback`` that publishes the model after every
  ``every_n_steps`` optimizer steps, for ``GRPOTrainer`` or any ``Trainer``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch

from ..publisher import Publisher

__all__ = ["DeltaSyncCallback", "DeltaSyncWeightTransfer"]

logger = logging.getLogger(__name__)

try:
    from transformers import TrainerCallback as _TrainerCallback
except ImportError:  # pragma: no cover - the trl extra brings transformers
    _TrainerCallback = object  # type: ignore[assignment,misc]


class DeltaSyncWeightTransfer:
    """A TRL ``WeightTransferProtocol`` that publishes each sync as a deltasync version.

    With a publisher of a LoRA adapter (``Publisher(adapter=...)``), each sync publishes the adapter of ``model``
    (the PEFT model), not merged: the weights the trainer streams (the adapter merged into the base, in TRL's
    merged path) are not read, and vLLM serves the adapter itself (the agent's apply mode ``lora``).

    Args:
        publisher: where versions go (store, coordinator, anchors). Closed by ``destroy``.
        wait: wait until each version is written and registered before returning (the trainer then
            blocks for the upload too); by default only the copy blocks.
        model: the PEFT model whose adapter an adapter publisher publishes.

    Raises:
        ValueError: an adapter publisher without ``model``.
    """

    def __init__(self, publisher: Publisher, *, wait: bool = False, model: torch.nn.Module | None = None) -> None:
        if publisher.adapter is not None and model is None:
            raise ValueError("an adapter publisher publishes the adapter of a PEFT model: pass model=peft_model")
        self.publisher, self.wait, self.model = publisher, wait, model
        self.syncs = 0
        self.versions: list[int] = []

    def init_weight_transfer(self) -> None:
        """Nothing to set up: the store and coordinator need no handshake."""

    def pause(self) -> None:
        """Nothing to do: each agent pauses its own engine, for the apply only."""

    def send_weights(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Copy every ``(name, tensor)`` (checkpoint names, full tensors) and publish them as one version (an
        adapter publisher: the adapter of ``model``, the stream left unread)."""
        if self.publisher.adapter is not None and self.model is not None:
            self.versions.append(self.publisher.publish(self.model, step=self.syncs))
        else:
            state = {name: tensor for name, tensor in iterator}
            self.versions.append(self.publisher.publish(state, step=self.syncs))
        self.syncs += 1
        if self.wait:
            self.publisher.flush()

    def resume(self) -> None:
        """Nothing to do (see ``pause``)."""

    def destroy(self) -> None:
        """Flush and close the publisher."""
        self.publisher.close()


class DeltaSyncCallback(_TrainerCallback):
    """Publishes the model on train begin (the anchor) and every ``every_n_steps`` optimizer steps.

    Args:
        publisher: where versions go. Flushed on train end (and closed, with ``close_on_end``).
        every_n_steps: publish after every this many optimizer steps.
        close_on_end: close the publisher when training ends.
    """

    def __init__(self, publisher: Publisher, *, every_n_steps: int = 1, close_on_end: bool = True) -> None:
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}")
        self.publisher, self.every_n_steps, self.close_on_end = publisher, every_n_steps, close_on_end
        self.versions: list[int] = []

    def _publish(self, model: Any, step: int) -> None:
        if model is not None:
            self.versions.append(self.publisher.publish(model, step))

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if not self.versions:
            self._publish(model, state.global_step)

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if state.global_step % self.every_n_steps == 0:
            self._publish(model, state.global_step)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.close_on_end:
            self.publisher.close()
        else:
            self.publisher.flush()
