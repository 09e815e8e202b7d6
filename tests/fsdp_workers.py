"""Worker processes for the FSDP2 test: two ranks on gloo, CPU, fully_shard, attach with the publisher on rank 0.

Scenarios (the fifth argument): "ok"; "drift", rank 1's mirror changed behind deltasync's back after the publish
of step 2; "fail", rank 1's step 4 raising after it wrote part of its mirror; "resume", a new publisher resumed
from the store at step 5 and attached again, publishing step 7; "restart", the same resumed by attach(start_step=5); "misuse", a publisher passed on rank 1 too; "callback", a
transformers DeltaSyncCallback on every rank instead of attach; "ahead", sync(6) ahead of the hook's count, then the
hook's steps and a sync of different steps on the two ranks; "tied", a tied weight of one row (rank 1's shard of it
empty); "fsdp1", an FSDP1 model, refused. Each rank writes what its syncs (or attach) raised to OUT.rank<N>.txt."""

from __future__ import annotations

import os
import sys

import torch


class Seen(torch.nn.Module):
    """Passes its input on and keeps a running mean of it in a buffer: FSDP2 leaves buffers plain tensors, each
    rank's own (they differ between ranks here, as running statistics do)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.mean.mul_(0.9).add_(0.1 * x.detach().float().reshape(-1, x.shape[-1]).mean(0))
        return x


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    # 11 and 5 rows: uneven shards over two ranks (FSDP2 pads the second internally).
    return torch.nn.Sequential(
        torch.nn.Embedding(11, 24), torch.nn.Linear(24, 5), torch.nn.LayerNorm(5), Seen(5), torch.nn.Linear(5, 1)
    )


class TiedRow(torch.nn.Module):
    """Two heads of one row, tied: sharded over two ranks, rank 1's shard of the weight is empty."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head, self.other = torch.nn.Embedding(11, 24), torch.nn.Linear(24, 1), torch.nn.Linear(24, 1)
        self.other.weight = self.head.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(x)
        return self.head(hidden) + self.other(hidden)


class _FailingOnce:
    """Stands in for MirrorDiff on a rank: its second chunk update of the step numbered ``at`` raises, after the
    first one wrote into the mirror."""

    def __init__(self, real, at: int) -> None:
        self.real, self.at, self.calls = real, at, 0

    def __call__(self, *args):
        builder, outer = self.real(*args), self

        class Builder:
            def __getattr__(self, name):
                return getattr(builder, name)

            def update(self, *update_args):
                outer.calls += 1
                if outer.calls == 2:
                    raise RuntimeError("simulated failure part way through a step")
                return builder.update(*update_args)

        return Builder()


def backward(model: torch.nn.Module, generator: torch.Generator) -> None:
    """One batch's gradients (this rank's own tokens)."""
    tokens = torch.randint(0, 11, (4, 3), generator=generator)
    model(tokens).square().mean().backward()


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole model in bf16 (a collective: every rank calls it); plain tensors (the buffer) as this rank holds
    them, which on rank 0 is what torch.save there would keep."""
    return {
        name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().to(torch.bfloat16)
        for name, p in model.state_dict().items()
    }


def run(rank: int, world: int, port: int, store: str, out: str, codec: str, scenario: str = "ok") -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import deltasync_rs as ds
    import deltasync_rs.torch as ds_torch

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        if scenario == "fsdp1":
            from torch.distributed.fsdp import FullyShardedDataParallel

            wrapped = FullyShardedDataParallel(build_model(), use_orig_params=True, device_id=torch.device("cpu"))
            optimizer = torch.optim.AdamW(wrapped.parameters(), lr=1e-3)
            publisher = ds.Publisher(store, anchor_every=100, codec=codec) if rank == 0 else None
            try:
                ds_torch.attach(optimizer, wrapped, publisher)
                message = "attach did not raise"
            except ds.DeltaSyncError as error:
                message = str(error)
            if publisher is not None:
                publisher.close()
            with open(f"{out}.rank{rank}.txt", "w") as report:
                report.write(message)
            dist.barrier()
            return
        model = build_model() if scenario != "tied" else TiedRow()
        for layer in model if scenario != "tied" else ():
            if any(True for _ in layer.parameters()):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        if scenario == "callback":
            # A transformers Trainer's callback, made on every rank with a Publisher of its own (as one script run
            # on every rank makes them), driven as the Trainer drives it.
            from deltasync_rs.integrations import DeltaSyncCallback

            callback = DeltaSyncCallback(ds.Publisher(store, anchor_every=100, codec=codec), sync_every=2)
            state = type("TrainerState", (), {"is_world_process_zero": rank == 0, "global_step": 0})()
            callback.on_train_begin(None, state, None, model=model)
            generator = torch.Generator().manual_seed(rank)
            for step in range(1, 6):
                backward(model, generator)
                optimizer.step()
                optimizer.zero_grad()
                state.global_step = step
                callback.on_step_end(None, state, None)
                if step == 4:
                    at_step_4 = full_state(model)  # a collective: on every rank
                    if rank == 0:
                        torch.save(at_step_4, f"{out}.step4")
            callback.on_train_end(None, state, None)
            whole = full_state(model)
            with open(f"{out}.rank{rank}.txt", "w") as report:
                report.write("")
            if rank == 0:
                torch.save(whole, out)
            callback.publisher.close()
            dist.barrier()
            return
        if scenario == "misuse":
            publisher = ds.Publisher(f"{store}-rank{rank}", anchor_every=100, codec=codec)
            try:
                ds_torch.attach(optimizer, model, publisher, sync_every=2)
                message = "attach did not raise"
            except ds.DeltaSyncError as error:
                message = str(error)
            publisher.close()
            with open(f"{out}.rank{rank}.txt", "w") as report:
                report.write(message)
            dist.barrier()
            return
        publisher = ds.Publisher(store, anchor_every=100, codec=codec) if rank == 0 else None
        attachment = ds_torch.attach(optimizer, model, publisher, sync_every=2)
        assert attachment.mirror.is_sharded
        generator = torch.Generator().manual_seed(rank)
        raised = []
        for step in range(1, 6):
            backward(model, generator)
            if scenario == "fail" and rank == 1 and step == 4:
                ds_torch.MirrorDiff = _FailingOnce(ds_torch.MirrorDiff, step)
            try:
                optimizer.step()
            except Exception as error:  # the sync in the optimizer's hook raised, on every rank alike
                raised.append(f"step {step}: {type(error).__name__}: {error}")
            if scenario == "fail" and rank == 1 and step == 4:
                ds_torch.MirrorDiff = ds_torch.MirrorDiff.real
            if scenario == "fail" and step == 4:
                # Step 4 synced again at once: rank 0's mirror moved to step 4, rank 1's did not; both sync again.
                attachment.sync()
            optimizer.zero_grad()
            if scenario == "drift" and rank == 1 and step == 2:
                # A sharded weight of rank 1's mirror changes behind deltasync's back (one bit-pattern step).
                name = next(name for name in attachment.mirror.shards if attachment.mirror.tensors[name].numel())
                attachment.mirror.tensors[name].view(torch.int16).view(-1)[0] += 1
        if scenario == "ahead":
            # Synced ahead of the hook's count: its next publishes (6 and 8) raise on every rank until its count
            # passes 11; the second finds the mirrors a step past the publisher's (the first moved them).
            attachment.sync(11)
            for step in range(6, 10):
                backward(model, generator)
                try:
                    optimizer.step()
                except ds.DeltaSyncError as error:
                    raised.append(f"hook {step}: {error}"[:60])
                optimizer.zero_grad()
            try:
                attachment.sync(12 + rank)
                raised.append("syncs of different steps did not raise")
            except ds.DeltaSyncError as error:
                raised.append(str(error))
            attachment.sync(12)
        else:
            attachment.sync()  # step 5, after the publishes at 2 and 4
        if scenario == "edited":
            attachment.sync()  # published already, and unchanged: nothing to do, on every rank
            if rank == 1:  # an edit after the step, in rank 1's shards only
                with torch.no_grad():
                    next(p for p in model.parameters() if p.to_local().numel()).to_local().mul_(0.5)
            try:
                attachment.sync()
                raised.append("sync of the edited step 5 did not raise")
            except ds.DeltaSyncError as error:
                raised.append(str(error))
            attachment.sync(6)
        if scenario in ("resume", "restart"):
            # A new publisher picks the run up from the store, as after a restart of rank 0's process: resumed by
            # hand from a pull ("resume"), or by attach at the step the store holds as the model ("restart").
            attachment.detach()
            shapes = full_state(model)  # a collective: on every rank
            if rank == 0:
                publisher.close()
                publisher = ds.Publisher(store, anchor_every=100, codec=codec)
                if scenario == "resume":
                    pulled = {name: torch.zeros_like(t) for name, t in shapes.items()}
                    assert ds.Subscriber(store).pull(pulled) == 5
                    publisher.resume(pulled, step=5)
            attachment = ds_torch.attach(
                optimizer, model, publisher, sync_every=2, start_step=5 if scenario == "restart" else 0
            )
            for _ in (6, 7):
                backward(model, generator)
                optimizer.step()
                optimizer.zero_grad()
        with open(f"{out}.rank{rank}.txt", "w") as report:
            report.write("\n".join(raised))
        whole = full_state(model)
        if rank == 0:
            publisher.close()
            torch.save(whole, out)
        # Both ranks tear down together: a rank that destroyed its process group and exited while the other was
        # still publishing died once in CI with a C++ abort ("terminate called without an active exception").
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    import torch.multiprocessing as mp

    port, store, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    codec = sys.argv[4] if len(sys.argv) > 4 else "varint"
    scenario = sys.argv[5] if len(sys.argv) > 5 else "ok"
    mp.spawn(run, args=(2, port, store, out, codec, scenario), nprocs=2)
