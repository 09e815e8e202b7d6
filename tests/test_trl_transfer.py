"""ds.integrations.trl.DeltaSyncWeightTransfer against a stand-in vLLM server on 127.0.0.1: an http.server thread
that records the routes TRL's async GRPO and our transfer call, and answers `/update_weights` by pulling the store
into a real CPU state with ds.Subscriber, as the `deltasync` engine does (python/deltasync_rs/vllm.py)."""

from __future__ import annotations

import json
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

import deltasync_rs as ds
from deltasync_rs.integrations.trl import DeltaSyncWeightTransfer, ServerError
from tests.helpers import assert_states_equal

SYNC_ROUTES = [
    "/pause?mode=keep",
    "/start_weight_update",
    "/update_weights",
    "/finish_weight_update",
    "/reset_prefix_cache",
    "/resume",
]


class Engine:
    """The server's weights and step, which outlive its HTTP listener (a network outage, not a restart). Its weight
    updates behave as vLLM 0.33's worker's: a start is refused while one is active, an update ends it on an error,
    a finish without one is refused; an update's store, where it names one, is the store pulled."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        self.state = state
        self.subscriber: ds.Subscriber | None = None
        self.calls: list[tuple[str, dict | None]] = []
        self.fail_updates = False
        self.update_seconds = 0.0
        self.active = False
        self.open_after_errors = False  # a server other than vLLM, which keeps a failed update open

    def handle(self, route: str, body: dict | None) -> int:
        self.calls.append((route, body))
        if route == "/init_weight_transfer_engine":
            info = body["init_info"]
            step = self.subscriber.step if self.subscriber else None
            self.subscriber = ds.Subscriber(info["store"])
            self.subscriber.step = info.get("current_step", step)
        elif route == "/start_weight_update":
            if self.active:
                return 500  # "start_weight_update called while a weight update is already active"
            self.active = True
        elif route == "/update_weights":
            if not self.active:
                return 500
            info = body["update_info"]
            if self.fail_updates or (self.subscriber is None and not info.get("store")):
                self.active = self.open_after_errors
                return 500
            if self.subscriber is None:
                self.subscriber = ds.Subscriber(info["store"])
            time.sleep(self.update_seconds)
            self.subscriber.pull(self.state, until=info["step"])
        elif route == "/finish_weight_update":
            if not self.active:
                return 500
            self.active = False
        return 200


class Server:
    """An HTTP listener for an Engine on 127.0.0.1, which can go away and come back on the same port."""

    def __init__(self, engine: Engine, port: int = 0) -> None:
        engine_ = engine

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                raw = self.rfile.read(length) if length else b""
                status = engine_.handle(self.path, json.loads(raw) if raw else None)
                self.send_response(status)
                self.send_header("content-length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, *args: object) -> None:
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        self.thread = threading.Thread(target=self.http.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.http.shutdown()
        self.http.server_close()
        self.thread.join(timeout=10)


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.ReLU(), torch.nn.Linear(48, 16))


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.randn(8, 64)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def export(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().to(torch.bfloat16) for name, p in model.named_parameters()}


def sync(transfer: DeltaSyncWeightTransfer, model: torch.nn.Module) -> None:
    """What AsyncGRPOTrainer._sync_weight_merged does on rank 0 (TRL 1.16)."""
    transfer.pause()
    transfer.send_weights((name, p.detach()) for name, p in model.named_parameters())
    transfer.resume()


@pytest.fixture
def setup(tmp_path):
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine = Engine({name: torch.zeros_like(t) for name, t in export(model).items()})
    server = Server(engine)
    publisher = ds.Publisher(tmp_path / "store", anchor_every=100)
    transfer = DeltaSyncWeightTransfer(publisher, server.url, timeout=5.0, update_timeout=30.0)
    yield model, optimizer, engine, server, publisher, transfer
    server.stop()
    publisher.close()


def test_each_sync_brings_the_server_to_the_trainers_bf16_weights(setup):
    model, optimizer, engine, server, publisher, transfer = setup
    transfer.init_weight_transfer()
    assert engine.calls == [("/init_weight_transfer_engine", {"init_info": {"store": publisher.store.url}})]
    for step in range(4):
        if step:
            train_step(model, optimizer)
        engine.calls.clear()
        sync(transfer, model)
        assert [route for route, _ in engine.calls] == SYNC_ROUTES
        assert engine.calls[1][1] == {"is_checkpoint_format": True}
        # the step and the store's URL (for a server restarted since its init), nothing else, cross over
        assert engine.calls[2][1] == {"update_info": {"step": step, "store": publisher.store.url}}
        assert_states_equal(engine.state, export(model))
        assert transfer.step == transfer.server_step == step and not transfer.behind
    assert [e.step for e in ds.Subscriber(publisher.store).fetch(0)] == [1, 2, 3]  # deltas, not anchors
    transfer.destroy()


def test_a_server_out_of_reach_falls_behind_and_catches_up(setup, caplog):
    model, optimizer, engine, server, publisher, transfer = setup
    transfer.init_weight_transfer()
    sync(transfer, model)
    port = int(server.url.rsplit(":", 1)[1])
    server.stop()
    with caplog.at_level(logging.WARNING, logger="deltasync_rs.trl"):
        for _ in range(2):
            train_step(model, optimizer)
            sync(transfer, model)  # publishing still works
    assert transfer.step == 2 and transfer.server_step == 0 and transfer.behind
    assert "out of reach" in caplog.text
    assert ds.Subscriber(publisher.store).latest_step() == 2
    assert engine.subscriber.step == 0

    server = Server(engine, port)  # back, with its weights where they were
    try:
        train_step(model, optimizer)
        engine.calls.clear()
        sync(transfer, model)
        assert [route for route, _ in engine.calls] == [
            "/pause?mode=keep",
            "/init_weight_transfer_engine",
            *SYNC_ROUTES[1:],
        ]
        assert engine.calls[1][1] == {"init_info": {"store": publisher.store.url}}  # keeps the server's own step
        assert transfer.server_step == 3 and not transfer.behind
        assert_states_equal(engine.state, export(model))  # deltas 1, 2 and 3 replayed from the store
    finally:
        server.stop()


def test_a_server_that_starts_late_pulls_from_the_anchor(tmp_path):
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with ds.Publisher(tmp_path / "store") as publisher:
        transfer = DeltaSyncWeightTransfer(publisher, "http://127.0.0.1:9", timeout=2.0)  # the discard port
        transfer.init_weight_transfer()
        sync(transfer, model)
        train_step(model, optimizer)
        sync(transfer, model)
        engine = Engine({name: torch.zeros_like(t) for name, t in export(model).items()})
        server = Server(engine)
        try:
            transfer.server_url = server.url
            train_step(model, optimizer)
            sync(transfer, model)
            assert_states_equal(engine.state, export(model))
            assert transfer.server_step == 2
        finally:
            server.stop()


def test_a_server_error_is_raised_after_the_publish(setup):
    model, optimizer, engine, server, publisher, transfer = setup
    transfer.init_weight_transfer()
    sync(transfer, model)
    engine.fail_updates = True
    train_step(model, optimizer)
    engine.calls.clear()
    transfer.pause()
    with pytest.raises(ServerError, match="/update_weights with 500"):
        transfer.send_weights((name, p.detach()) for name, p in model.named_parameters())
    # No finish after it: vLLM ended the update on every rank, and would refuse a finish on every rank (which at
    # TP > 1 leaves replies unread).
    assert [route for route, _ in engine.calls][-1] == "/update_weights" and not engine.active
    assert ds.Subscriber(publisher.store).latest_step() == 1 and transfer.behind
    engine.fail_updates = False
    train_step(model, optimizer)
    sync(transfer, model)
    assert_states_equal(engine.state, export(model))


def test_a_server_that_keeps_a_failed_update_open_gets_it_finished_by_the_next_sync(setup):
    model, optimizer, engine, server, publisher, transfer = setup
    transfer.init_weight_transfer()
    sync(transfer, model)
    engine.fail_updates = engine.open_after_errors = True
    train_step(model, optimizer)
    transfer.pause()
    with pytest.raises(ServerError, match="/update_weights with 500"):
        transfer.send_weights((name, p.detach()) for name, p in model.named_parameters())
    assert engine.active
    engine.fail_updates = False
    train_step(model, optimizer)
    engine.calls.clear()
    sync(transfer, model)
    assert [route for route, _ in engine.calls if "weight_update" in route or "update_weights" in route][:4] == [
        "/start_weight_update",  # refused: the failed update is still open
        "/finish_weight_update",
        "/start_weight_update",
        "/update_weights",
    ]
    assert_states_equal(engine.state, export(model))


def test_options_of_the_wrong_kind_are_refused_when_the_transfer_is_made(tmp_path):
    with ds.Publisher(tmp_path, background=False) as publisher:
        for arguments, options, match in [
            (("",), {}, "server_url must be"),
            ((None,), {}, "server_url must be"),
            (("127.0.0.1:8000",), {}, "server_url must be"),
            (("http://127.0.0.1:9",), {"timeout": "5"}, "timeout must be a number of seconds"),
            (("http://127.0.0.1:9",), {"update_timeout": 0}, "update_timeout must be a number of seconds, above 0"),
            (("http://127.0.0.1:9",), {"dtype": "bf16"}, "dtype"),
        ]:
            with pytest.raises(ds.DeltaSyncError, match=match):
                DeltaSyncWeightTransfer(publisher, *arguments, **options)


def test_a_sync_that_leaves_out_a_tensor_is_refused_and_the_next_one_is_an_anchor(setup):
    """A sync that streamed part of the weights into the mirror and then failed publishes nothing; the next full
    sync is published as an anchor (no delta from the half-moved mirror), and the server ends with the model."""
    model, optimizer, engine, server, publisher, transfer = setup
    transfer.init_weight_transfer()
    sync(transfer, model)
    train_step(model, optimizer)
    params = list(model.named_parameters())
    with pytest.raises(ds.BaseMismatchError, match="did not send 1 tensor"):
        transfer.send_weights((name, p.detach()) for name, p in params[:-1])
    assert ds.Subscriber(publisher.store).latest_step() == 0
    train_step(model, optimizer)
    sync(transfer, model)
    entries = ds.sync.log_entries(publisher.store)
    assert [(e.step, e.delta is None) for e in entries] == [(0, True), (1, True)]
    assert_states_equal(engine.state, export(model))


def test_weights_of_another_dtype_are_shipped_as_bf16(setup):
    model, optimizer, engine, server, publisher, transfer = setup
    transfer.init_weight_transfer()
    sync(transfer, model)  # fp32 parameters, cast tensor by tensor
    assert all(t.dtype == torch.bfloat16 for t in engine.state.values())
    model.to(torch.bfloat16)
    sync(transfer, model)  # bf16 parameters are read in place
    assert_states_equal(engine.state, export(model))


@pytest.mark.parametrize("codec", ["varint", "context"])
def test_the_transfer_ships_the_publishers_codec(tmp_path, codec):
    """The transfer's mirror writes the codec the publisher was made with (it once wrote compact whatever it was)."""
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine = Engine({name: torch.zeros_like(t) for name, t in export(model).items()})
    server = Server(engine)
    try:
        with ds.Publisher(tmp_path / "store", anchor_every=100, codec=codec) as publisher:
            transfer = DeltaSyncWeightTransfer(publisher, server.url, timeout=5.0, update_timeout=30.0)
            sync(transfer, model)
            before = export(model)
            train_step(model, optimizer)
            sync(transfer, model)
            assert_states_equal(engine.state, export(model))
            want = ds.diff(before, export(model), codec=codec, step=1, base_step=0)
            assert publisher.store.get(ds.sync.delta_key(1)) == want.to_bytes()
    finally:
        server.stop()


def test_an_update_that_outlives_its_timeout_does_not_block_the_next_syncs(setup, caplog):
    """The server went on with an update after the transfer stopped waiting for it: its update stayed active, and
    vLLM refused every later start, so no sync ever went through again (found by an adversarial helper). The next
    sync finishes the update left open first."""
    model, optimizer, engine, server, publisher, transfer = setup
    sync(transfer, model)
    transfer.update_timeout = 0.5
    engine.update_seconds = 1.5
    train_step(model, optimizer)
    with caplog.at_level(logging.WARNING, logger="deltasync_rs"):
        sync(transfer, model)
    assert "out of reach" in caplog.text
    engine.update_seconds = 0.0
    time.sleep(1.5)  # the server has finished its pull by now; its update is still active
    for _ in range(2):
        train_step(model, optimizer)
        sync(transfer, model)
        assert transfer.server_step == transfer.step and not transfer.behind
        assert_states_equal(engine.state, export(model))


def test_a_restarted_server_is_brought_up_to_date_by_the_next_sync(setup, tmp_path):
    """A server restarted between two syncs has no store (its init is gone): every update named only the step, so
    every later sync failed (found by an adversarial helper). Each update names the store, and a server error makes
    the next sync send the init again."""
    model, optimizer, engine, server, publisher, transfer = setup
    sync(transfer, model)
    port = int(server.url.rsplit(":", 1)[1])
    server.stop()
    restarted = Engine({name: torch.zeros_like(t) for name, t in export(model).items()})
    server2 = Server(restarted, port)
    try:
        train_step(model, optimizer)
        sync(transfer, model)
        assert_states_equal(restarted.state, export(model))
        restarted.subscriber = None  # and a restart the transfer could not tell from a plain error
        restarted.fail_updates = True
        train_step(model, optimizer)
        with pytest.raises(ServerError):
            sync(transfer, model)
        restarted.fail_updates = False
        train_step(model, optimizer)
        sync(transfer, model)
        assert [route for route, _ in restarted.calls].count("/init_weight_transfer_engine") == 1
        assert_states_equal(restarted.state, export(model))
    finally:
        server2.stop()
