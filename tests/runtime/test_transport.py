"""Joining a microbatch's pieces on the device (``runtime/transport.py``, ``Transport._joined``).

A consumer microbatch made of several producers' pieces holds the pieces and their join at once
while the join is made. Prefetched on an inbound stream with nothing to hold it back, that moment
can fall on the running unit's peak and take the device past its planned peak. The join is a copy
made ahead of need and waits for room like one, by the ledger's count (``runtime/ledger.py``): the
running unit's planned bytes and the pieces.
"""

from __future__ import annotations

import threading
import time
import types

import torch

from harmony.runtime.admission import Admission
from harmony.runtime.device import CpuDevice
from harmony.runtime.ledger import STATE, Ledger
from harmony.runtime.transport import Transport
from harmony.scheduler.tasks import MemoryPlan

PIECE = 40  # float64 elements in each piece: 320 bytes


class _Aborted:
    def aborted(self) -> bool:
        return False


class _Context:
    """What a join reads of a device's context: its device and ledger, nothing held or leaving."""

    def __init__(self, device: CpuDevice) -> None:
        self.rank = 0
        self.device = device
        self.ledger = Ledger()
        self.shared = _Aborted()
        self.local: dict = {}
        self.resident: dict = {}
        self.waiting = False
        self.task = 1
        self.layers = _OneBoundary()


class _OneBoundary:
    """A layer graph whose one boundary holds samples along dim 0 of its first value."""

    layers = [types.SimpleNamespace(index=0)]

    def input_batch_dims(self, index: int) -> list:
        return [0, None]


def _joiner(device: CpuDevice, budget: int) -> Transport:
    """A transport on a device whose plan peaks at ``budget``, with no mailbox or peers: a join
    needs none."""
    ctx = _Context(device)
    admission = Admission(ctx, MemoryPlan(devices={0: budget}, tasks={}, reserves={}))
    return Transport(ctx, admission, mailbox=None, peers=[], slabs=None, dist=None)


def _warm_up(device: CpuDevice) -> None:
    """A first op under a dispatch mode on a new thread takes torch seconds to set up; the join
    must not pass the waiting test only because it had not started yet."""
    def op() -> None:
        with device.memory_scope():
            torch.cat([torch.zeros(1), torch.zeros(1)])

    thread = threading.Thread(target=op)
    thread.start()
    thread.join()


def _pieces(device: CpuDevice, joiner: Transport) -> list[list]:
    """Two pieces of microbatch 1 of task 1, received while its microbatch 0 computes."""
    parts = [[device.to_device(torch.full((PIECE,), float(i), dtype=torch.float64)), "whole"] for i in range(2)]
    joiner.ctx.ledger.hold([p[0] for p in parts], (1, 1))
    return parts


def test_a_prefetched_join_waits_until_pieces_and_join_fit_under_the_planned_peak():
    device = CpuDevice("dev0", capacity=100_000)
    joiner = _joiner(device, budget=1_400)
    parts = _pieces(device, joiner)
    joiner.ctx.ledger.run([(1, STATE), (1, 0)], planned=400)  # the running unit's 400 bytes
    result: list = []
    _warm_up(device)

    def prefetch() -> None:
        with device.memory_scope():
            result.append(joiner._joined(parts, 0, (1, 1)))

    stream = threading.Thread(target=prefetch, name="harmony-dev0-p2p-in")  # a stream thread, not the compute thread
    stream.start()
    time.sleep(0.5)
    assert not result, "the join was made while pieces, join and the running unit exceed the planned peak"
    joiner.ctx.ledger.idle()  # the running unit ends: pieces and their join fit under the peak
    stream.join(timeout=5)
    joined, whole = result[0]
    assert whole == "whole"
    assert torch.equal(joined, torch.cat([torch.zeros(PIECE), torch.ones(PIECE)]).double())
    assert device.peak() == 4 * PIECE * 8  # pieces and join


def test_a_join_the_compute_thread_waits_for_is_made_at_once_past_the_planned_peak():
    device = CpuDevice("dev0", capacity=100_000)
    joiner = _joiner(device, budget=700)
    parts = _pieces(device, joiner)
    joiner.ctx.waiting = True  # the compute thread is blocked on this join
    with device.memory_scope():
        joined, _ = joiner._joined(parts, 0, (1, 1))
    assert joined.shape == (2 * PIECE,)
    assert device.peak() == 4 * PIECE * 8


def test_a_single_piece_is_its_own_join_and_copies_nothing():
    device = CpuDevice("dev0", capacity=100_000)
    joiner = _joiner(device, budget=0)
    parts = _pieces(device, joiner)[:1]
    assert joiner._joined(parts, 0, (1, 1)) is parts[0]
