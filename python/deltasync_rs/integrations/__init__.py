"""Trainer integrations: a transformers ``TrainerCallback`` (and so TRL's trainers) that publishes the weights every
``sync_every`` optimizer steps through a Publisher, from a ds.torch.Mirror. Importing this module imports
transformers; ``import deltasync_rs`` does not. ``deltasync_rs.integrations.trl`` holds the ``weight_transfer`` for
TRL's async GRPO trainer."""

from __future__ import annotations

import logging
from typing import Any

import torch
from transformers import TrainerCallback

from ..errors import DeltaSyncError, at_least_one, flag
from ..torch import Mirror, _holds_dtensors, _publish_step

log = logging.getLogger("deltasync_rs.integrations")


class DeltaSyncCallback(TrainerCallback):
    """Publishes the model at the start of training and then every ``sync_every`` global steps (``on_step_end``),
    each time as the delta from the last published state, and the training's last step, from the weights trained
    to it (``on_step_end``, before the Trainer may load its best checkpoint). Only the main process publishes. With
    ``enabled=False`` (or once ``enabled`` is set to False) it does nothing at all.

    After ``trainer.train(resume_from_checkpoint=...)`` from the checkpoint of a step it published, it resumes the
    publisher at that step (``resume=True``, the default; as ``ds.torch.attach`` does): nothing is published for it,
    the store's later steps, a history the run leaves, are removed, and the next publish is a delta. A store that
    holds that step as other weights is an IntegrityError; one that never held it (not a multiple of
    ``sync_every``, or removed by retention) is refused as a step not after the store's newest: call
    ``publisher.resume`` yourself then, or publish into a new store.

    An FSDP2 (DTensor) model is published as ``ds.torch.attach`` does: every process mirrors and diffs its own
    shards and the main process joins them (its ``publisher`` publishes; the other processes' are not used, and may
    be None), so the callback must be on every process, as the Trainer's callbacks are."""

    def __init__(
        self,
        publisher: Any,
        sync_every: int = 1,
        *,
        dtype: torch.dtype = torch.bfloat16,
        chunk_bytes: int = 64 << 20,
        enabled: bool = True,
        resume: bool = True,
    ) -> None:
        from ..publisher import Publisher

        # Checked here, not at the first step of training: a publisher that is not one, or `enabled="no"` (true),
        # would otherwise surface as an AttributeError in on_train_begin, or not at all.
        if publisher is not None and not isinstance(publisher, Publisher):
            raise DeltaSyncError(
                f"publisher must be a deltasync_rs.Publisher (or None), not {type(publisher).__name__}"
            )
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise DeltaSyncError(f"dtype must be a floating-point torch.dtype, not {dtype!r}")
        if at_least_one(chunk_bytes, "chunk_bytes") < 64:
            raise DeltaSyncError(f"chunk_bytes must be at least 64, not {chunk_bytes}")
        self.publisher: Any = publisher
        self.sync_every = at_least_one(sync_every, "sync_every")
        self.dtype = dtype
        self.chunk_bytes = chunk_bytes
        self.enabled = flag(enabled, "enabled")
        self.resume = flag(resume, "resume")
        self.mirror: Mirror | None = None
        self._sharded: Any = None  # for an FSDP2 model: a ds.torch Attachment without an optimizer hook

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if not self.enabled:
            return
        if model is not None and _holds_dtensors(model):
            from ..torch import Attachment

            # Rank 0's publisher starts from its own step where it has one (resumed), as for a plain model.
            self._sharded = Attachment(
                None,
                model,
                self.publisher if state.is_world_process_zero else None,
                sync_every=1,
                dtype=self.dtype,
                chunk_bytes=self.chunk_bytes,
                start_step=state.global_step,
                resume=self.resume,
            )
            self.mirror = self._sharded.mirror
            return
        if not state.is_world_process_zero:
            return
        if model is None:
            raise DeltaSyncError("DeltaSyncCallback needs the model: the Trainer passes it to on_train_begin")
        if self.publisher.step is not None and state.global_step < self.publisher.step:
            # The same publisher kept across trainings (a notebook): it is past the step training starts from.
            raise DeltaSyncError(
                f"the trainer starts at step {state.global_step}, before this publisher's step {self.publisher.step}: "
                "a publisher goes on from its own last step only. Publish this training into a new store, or, where "
                f"the store holds step {state.global_step} as these very weights (a resume from its checkpoint), "
                "close this publisher and pass a new Publisher on the store (README, Restarts)"
            )
        if self.publisher.step is not None and state.global_step > self.publisher.step:
            # Trained again in this process from a checkpoint saved between two syncs: these weights were never
            # published, so the publisher's last state is no base for them.
            raise DeltaSyncError(
                f"the trainer starts at step {state.global_step}, after this publisher's step {self.publisher.step}, "
                "from weights it never published (a checkpoint saved between two syncs): close this publisher and "
                f"pass a new Publisher on the store, which publishes step {state.global_step} as an anchor"
            )
        step = self.publisher.step if self.publisher.step is not None else state.global_step
        self.mirror = Mirror(
            model,
            self.dtype,
            chunk_bytes=self.chunk_bytes,
            values=self.publisher.values,
            codec=self.publisher.codec,
            step=step,
        )
        self.publisher.publish_shared(step, self.mirror.tensors, resume=self.resume, aliases=self.mirror.aliases)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not self.enabled or self.mirror is None:
            return
        # Every sync_every steps, and the training's last step (max_steps not a multiple of sync_every), published
        # here, while the model holds the weights trained to it (at the end the Trainer may load another checkpoint).
        last = bool(getattr(control, "should_training_stop", False)) or (
            getattr(state, "max_steps", 0) > 0 and state.global_step >= state.max_steps
        )
        if state.global_step % self.sync_every and not last:
            return
        self._publish(state.global_step)

    def _publish(self, step: int) -> None:
        if self._sharded is not None:  # on every process: the ranks gather their deltas
            self._sharded.sync(step)
        elif self.mirror is not None and step != self.mirror.current_step:
            _publish_step(self.publisher, self.mirror, step)

    def _published(self) -> int | None:
        if self._sharded is not None:
            step: int | None = self._sharded.published_step
            return step
        return self.mirror.current_step if self.mirror is not None else None

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not self.enabled or self.mirror is None:
            return
        if self._published() != state.global_step:
            # Training stopped off the steps published (early stopping, after on_step_end had run).
            if getattr(args, "load_best_model_at_end", False) and getattr(state, "best_model_checkpoint", None):
                # The Trainer has loaded the best checkpoint in place of the weights trained to this step.
                log.warning(
                    "the weights trained after step %s were not published: the Trainer loaded its best checkpoint "
                    "before the training's end (load_best_model_at_end)",
                    self._published(),
                )
            else:
                self._publish(state.global_step)
        if state.is_world_process_zero:
            self.publisher.flush()


__all__ = ["DeltaSyncCallback"]
