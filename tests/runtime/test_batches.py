"""The minibatch hand-off: buffers the workers keep are refilled, not sent again."""

import torch

from harmony.runtime.batches import BatchSlots, received
from harmony.runtime.context import Batch


def _batch(x, target, seed=0, extra=None):
    inputs = [x] if extra is None else [x, extra]
    return Batch(inputs=inputs, target=target, size=x.shape[0], seed=seed)


def test_a_minibatch_of_the_same_shapes_is_copied_into_the_buffers_the_workers_hold():
    slots = BatchSlots()
    first = slots.fill(_batch(torch.zeros(4, 3), torch.zeros(4, dtype=torch.long)))
    assert first is not None and first.inputs[0].is_shared() and first.target.is_shared()
    x, t = torch.randn(4, 3), torch.arange(4)
    assert slots.fill(_batch(x, t)) is None
    held = received(None, first)
    assert held is first
    assert torch.equal(held.inputs[0], x) and torch.equal(held.target, t)
    x[0, 0] = 99.0  # the buffers are copies: the caller's tensors stay theirs
    assert held.inputs[0][0, 0] != 99.0


def test_a_minibatch_of_another_shape_dtype_value_or_seed_is_sent_whole():
    slots = BatchSlots()
    base = slots.fill(_batch(torch.zeros(4, 3), torch.zeros(4)))
    for other in (_batch(torch.zeros(4, 5), torch.zeros(4)),
                  _batch(torch.zeros(4, 5, dtype=torch.float64), torch.zeros(4)),
                  _batch(torch.zeros(4, 5, dtype=torch.float64), torch.zeros(4), seed=3),
                  _batch(torch.zeros(4, 5, dtype=torch.float64), torch.zeros(4), seed=3, extra=2),
                  _batch(torch.zeros(4, 5, dtype=torch.float64), torch.zeros(4), seed=3, extra=7)):
        sent = slots.fill(other)
        assert sent is not None and sent is not base
        assert received(sent, base) is sent
        base = sent
    assert slots.fill(_batch(torch.ones(4, 5, dtype=torch.float64), torch.ones(4), seed=3, extra=7)) is None
