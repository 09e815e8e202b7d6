"""A ``weight_transfer`` for TRL's async GRPO (``trl.experimental.async_grpo.AsyncGRPOTrainer``, TRL 1.16): each
sync publishes the trainer's weights to a store as a delta, then asks a ``vllm serve`` running the ``deltasync``
weight-transfer engine (python/deltasync_rs/vllm.py) to pull that step. Only the store's address and a step number
travel to the server; a server out of reach never fails the publish and catches up at the next sync it answers.
TRL itself is not imported: the trainer calls the five methods of its ``WeightTransferProtocol``."""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import torch

from .. import _arrays
from .._core import MirrorDiff
from ..delta import Delta, _finish
from ..errors import BaseMismatchError, DeltaSyncError, seconds
from ..torch import _dtensor_type, shipped_dtype

log = logging.getLogger("deltasync_rs.trl")


class ServerError(DeltaSyncError):
    """The vLLM server answered a weight-sync route with an error status (it was reachable, and refused)."""


class _Unreachable(Exception):
    """The server did not answer: refused connection, reset, or no reply within the timeout."""


class DeltaSyncWeightTransfer:
    """TRL's ``WeightTransferProtocol`` over a deltasync store.

    ``send_weights`` streams the trainer's ``(name, tensor)`` pairs once, tensor by tensor, into a CPU mirror in
    ``dtype`` (floating-point tensors are cast; others keep their dtype): the first sync copies them and publishes an
    anchor, each later one compares every tensor with its mirror and writes the new bits in the same pass (the core's
    ``MirrorDiff``), so besides the mirror only one tensor's cast copy is ever held. The publisher shares the mirror
    rather than copying it. The sync is published as step ``start_step``, then ``start_step + 1``, ... and uploaded
    (``publisher.flush``) before the server is asked to pull it, in ``/start_weight_update``, ``/update_weights``
    ``{"update_info": {"step": N}}``, ``/finish_weight_update``, then ``/reset_prefix_cache``.

    ``store_url`` is the store as the server reads it (default: the publisher's). ``server_step`` is the step the
    served checkpoint already holds, if known; otherwise the server's first pull starts from an anchor. When the
    server is out of reach (refused, reset, or silent past ``timeout`` / ``update_timeout`` seconds) a warning is
    logged and ``server_step`` stays behind ``step``; the next sync re-initialises the engine and its pull replays
    every missed delta from the store. A server that answers with an error raises :class:`ServerError`.

    FSDP2: TRL's iterator yields whole tensors on rank 0 (it all-gathers each DTensor with ``full_tensor()`` on every
    rank), so rank 0's mirror is a whole copy. A DTensor reaching ``send_weights`` is refused: gathering it there,
    on rank 0 alone, would hang the other ranks. To diff per-rank shards instead, use ``ds.torch.attach``.

    A failure while streaming (a tensor left out, or sent twice, or of another shape; an error from the iterator)
    leaves the mirror between two steps: the sync raises, and the next one, once it has streamed every tensor again,
    is published as an anchor (the publisher's rule after a publish that raised part way), which the server pulls.
    """

    def __init__(
        self,
        publisher: Any,
        server_url: str,
        *,
        store_url: str | None = None,
        dtype: torch.dtype = torch.bfloat16,
        start_step: int = 0,
        server_step: int | None = None,
        timeout: float = 30.0,
        update_timeout: float = 600.0,
        upload_timeout: float = 600.0,
    ) -> None:
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise DeltaSyncError(f"the shipped dtype must be a floating-point torch.dtype, not {dtype!r}")
        if not isinstance(server_url, str) or not server_url.startswith(("http://", "https://")):
            raise DeltaSyncError(f"server_url must be the vLLM server's http:// or https:// URL, not {server_url!r}")
        for value, name in (
            (timeout, "timeout"),
            (update_timeout, "update_timeout"),
            (upload_timeout, "upload_timeout"),
        ):
            seconds(value, name, positive=True)
        if isinstance(start_step, bool) or not isinstance(start_step, int) or start_step < 0:
            raise DeltaSyncError(f"start_step must be a non-negative integer, not {start_step!r}")
        self.publisher = publisher
        self.server_url = server_url.rstrip("/")
        self.store_url = store_url or publisher.store.url
        self.dtype = dtype
        self.timeout = timeout
        self.update_timeout = update_timeout
        self.upload_timeout = upload_timeout
        self.step: int | None = None  # the last step published
        self.server_step = server_step  # the last step the server is known to hold
        self._next_step = start_step
        self._engine_ready = False
        #: A ``/start_weight_update`` was sent and its ``/finish_weight_update`` not answered.
        self._update_open = False
        self._declared_step = server_step  # sent as current_step until an init_weight_transfer_engine succeeds
        self._tensors: dict[str, torch.Tensor] = {}
        self._bytes: dict[str, Any] = {}  # flat uint8 views of the mirror, which the core writes in place

    @property
    def behind(self) -> bool:
        """True when the server is not known to hold the last published step."""
        return self.step is not None and self.server_step != self.step

    # --- WeightTransferProtocol ---

    def init_weight_transfer(self) -> None:
        """Points the server's engine at the store; a server out of reach is initialised at the next sync."""
        try:
            self._init_engine()
        except _Unreachable as reason:
            log.warning(
                "vLLM server %s is out of reach (%s); it will be initialised at the next sync", self.server_url, reason
            )

    def pause(self) -> None:
        self._post_or_warn("/pause?mode=keep", None)

    def resume(self) -> None:
        self._post_or_warn("/resume", None)

    def send_weights(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Publishes the weights ``iterator`` yields as the next step, then has the server pull it."""
        step = self._next_step
        if not self._tensors:
            try:
                self._first(iterator)
                self.publisher.publish_shared(step, self._tensors)
            except BaseException:
                self._tensors, self._bytes = {}, {}  # nothing was shared: the next sync starts over
                raise
        else:
            # A sync that raises part way leaves the mirror between two steps: the publisher then publishes the
            # next sync as an anchor.
            self.publisher.publish_shared(step, self._tensors, lambda: self._advance(iterator, step))
        self.step, self._next_step = step, step + 1
        self.publisher.flush(timeout=self.upload_timeout)
        self._update_server(step)

    def destroy(self) -> None:
        """Waits for the uploads and drops the mirror; the publisher stays the caller's to close."""
        self.publisher.flush(timeout=self.upload_timeout)
        self._tensors, self._bytes = {}, {}

    # --- the mirror ---

    def _host(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` on the CPU in the shipped dtype, contiguous: the tensor itself when it already is."""
        if isinstance(tensor, _dtensor_type() or ()):
            raise DeltaSyncError(
                f"tensor {name!r} is a DTensor shard: send whole tensors (TRL gathers them with "
                "full_tensor()), or diff shards per rank with ds.torch.attach"
            )
        if not isinstance(tensor, torch.Tensor):
            raise DeltaSyncError(f"tensor {name!r}: expected a torch.Tensor, got {type(tensor).__name__}")
        return tensor.detach().to("cpu", shipped_dtype(tensor.dtype, self.dtype)).contiguous()

    def _first(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
        tensors: dict[str, torch.Tensor] = {}
        for name, tensor in iterator:
            if name in tensors:
                raise DeltaSyncError(f"tensor {name!r} was sent twice in one sync")
            host = self._host(name, tensor)
            tensors[name] = host.clone() if host.data_ptr() == tensor.data_ptr() else host
        if not tensors:
            raise DeltaSyncError("the first sync sent no tensors")
        self._tensors = tensors
        self._bytes = {name: t.view(-1).view(torch.uint8) for name, t in tensors.items()}

    def _advance(self, iterator: Iterator[tuple[str, torch.Tensor]], step: int) -> Delta:
        """One pass over the iterator: each tensor is compared with its mirror, which takes its bits as the core
        records the changes. Every tensor of the mirror must come exactly once."""
        builder = MirrorDiff(self.publisher.values, self.publisher.codec)
        seen: set[str] = set()
        for name, tensor in iterator:
            mirror = self._tensors.get(name)
            if mirror is None:
                raise BaseMismatchError(f"tensor {name!r} was not in the first sync")
            if name in seen:
                raise DeltaSyncError(f"tensor {name!r} was sent twice in one sync")
            host = self._host(name, tensor)
            if host.dtype != mirror.dtype or host.shape != mirror.shape:
                raise BaseMismatchError(
                    f"tensor {name!r}: sent as {host.dtype}{list(host.shape)}, mirrored as "
                    f"{mirror.dtype}{list(mirror.shape)}"
                )
            dtype_name, shape = _arrays.describe(mirror, name)
            builder.advance([(name, dtype_name, list(shape), self._bytes[name], host)])
            seen.add(name)
        missing = [name for name in self._tensors if name not in seen]
        if missing:
            raise BaseMismatchError(f"the sync did not send {len(missing)} tensor(s) of the first one: {missing[:5]}")
        return _finish(builder.take(), step, self.step, None)

    # --- the server ---

    def _update_server(self, step: int) -> None:
        try:
            if not self._engine_ready:
                self._init_engine()
            self._start_update()
            try:
                # The store in every update too: a server restarted since its init still knows where to pull from.
                self._post(
                    "/update_weights", {"update_info": {"step": step, "store": self.store_url}}, self.update_timeout
                )
            except ServerError:
                # vLLM's worker ends the update itself on an error (every tensor-parallel rank, docs/vllm.md §4), so
                # no finish is posted: vLLM refuses it on every rank, and at TP > 1 a refusal every rank raises
                # leaves replies unread that later calls would get. A server that keeps the update open refuses the
                # next start, which `_start_update` then finishes.
                self._update_open = False
                raise
            self._post("/finish_weight_update", None)
            self._update_open = False
            self.server_step = step
            self._post("/reset_prefix_cache", None)
        except ServerError:
            self._engine_ready = False  # a server restarted since its init answers errors: init it again next time
            raise
        except _Unreachable as reason:
            self._engine_ready = False  # a restarted server needs the store again
            log.warning(
                "published step %d, but vLLM server %s is out of reach (%s); it is at step %s and will "
                "catch up from the store at the next sync",
                step,
                self.server_url,
                reason,
                self.server_step,
            )

    def _start_update(self) -> None:
        """``/start_weight_update``. An update a sync left open (its ``/update_weights`` timed out while the server
        went on with it, or its ``/finish_weight_update`` was out of reach) is finished first, and a start refused
        is tried once more after a finish: vLLM refuses to start an update while one is active, and every later
        sync failed."""
        if self._update_open:
            self._finish_left_open()
        try:
            self._post("/start_weight_update", {"is_checkpoint_format": True})
        except ServerError:
            if not self._finish_left_open():
                raise
            self._post("/start_weight_update", {"is_checkpoint_format": True})
        self._update_open = True

    def _finish_left_open(self) -> bool:
        """Finishes an update a sync may have left active; False where the server had none."""
        try:
            self._post("/finish_weight_update", None)
        except ServerError as error:
            log.debug("finish_weight_update of an update left open: %s", error)
            return False
        finally:
            self._update_open = False
        return True

    def _init_engine(self) -> None:
        info: dict[str, Any] = {"store": self.store_url}
        if self._declared_step is not None:
            info["current_step"] = self._declared_step
        self._post("/init_weight_transfer_engine", {"init_info": info})
        self._engine_ready, self._declared_step = True, None

    def _post_or_warn(self, route: str, body: dict[str, Any] | None) -> None:
        try:
            self._post(route, body)
        except _Unreachable as reason:
            log.warning("vLLM server %s is out of reach for %s (%s)", self.server_url, route, reason)

    def _post(self, route: str, body: dict[str, Any] | None, timeout: float | None = None) -> None:
        data = b"" if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.server_url + route, data=data, method="POST", headers={"content-type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout or self.timeout) as response:
                response.read()
        except urllib.error.HTTPError as error:
            detail = error.read().decode(errors="replace")[:2000]
            raise ServerError(f"vLLM server {self.server_url} answered {route} with {error.code}: {detail}") from None
        except (urllib.error.URLError, OSError) as error:  # refused, reset, timed out (TimeoutError is an OSError)
            raise _Unreachable(f"{route}: {getattr(error, 'reason', error)}") from None


__all__ = ["DeltaSyncWeightTransfer", "ServerError"]
