"""Running the layers in sequence reproduces the original model: outputs, gradients, buffers."""

from __future__ import annotations

import copy

import pytest
import torch

import harmony
from zoo import FACTORIES, RTOL, assert_layers_match_model, tensor_leaves

MODELS = list(FACTORIES)
# float64 (10 digits) for every model; float32 (5 digits) for one model per tracer and for batch norm,
# to keep the suite fast on two cores
FLOAT64 = [pytest.param(n, torch.float64, id=f"{n}-float64") for n in MODELS]
FLOAT32 = [pytest.param(n, torch.float32, id=f"{n}-float32") for n in ("gpt2", "resnet", "hf_gpt2")]


@pytest.mark.parametrize("name, dtype", FLOAT64 + FLOAT32[:1])
def test_layers_match_model_in_eval_mode(name, dtype):
    model, inputs = FACTORIES[name](dtype, dropout=True)
    model.eval()  # dropout present but disabled, batch norm uses running statistics
    lg = assert_layers_match_model(model, inputs, RTOL[dtype])
    assert len(lg) > 1, "a model with several blocks must decompose into several layers"


@pytest.mark.parametrize("name, dtype", FLOAT64 + FLOAT32)
def test_layers_match_model_with_seeded_dropout_and_batchnorm_in_train_mode(name, dtype):
    model, inputs = FACTORIES[name](dtype, dropout=True)
    model.train()
    has_dropout = any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules()) or name.startswith("hf_")
    if has_dropout:
        # the comparison only means something if dropout really draws random numbers
        probe = copy.deepcopy(model)
        torch.manual_seed(0)
        a = tensor_leaves(probe(*inputs))[0]
        torch.manual_seed(1)
        b = tensor_leaves(probe(*inputs))[0]
        assert not torch.equal(a, b), "dropout is not active in train mode"
    has_bn = any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())
    before = {k: v.clone() for k, v in model.named_buffers()}
    assert_layers_match_model(model, inputs, RTOL[dtype], seed=7)
    if has_bn:  # the layered step updated the running statistics (and equally, checked above)
        changed = [k for k, v in model.named_buffers() if "running_mean" in k and not torch.equal(v, before[k])]
        assert changed, "batch-norm running statistics were not updated by the layered run"


@pytest.mark.parametrize("name", ["gpt2", "resnet"])
def test_layers_keep_matching_over_several_train_steps(name):
    """Repeated layered forward/backward/SGD steps track the eager model step for step."""
    model, inputs = FACTORIES[name](torch.float64, dropout=True)
    model.train()
    reference = copy.deepcopy(model)
    lg = harmony.decompose(model, inputs)
    assert len(list(lg.parameters())) == len(list(model.parameters()))  # tied parameters once
    opt_ref = torch.optim.SGD(reference.parameters(), lr=0.05)
    opt = torch.optim.SGD(lg.parameters(), lr=0.05)
    for step in range(3):
        for fn, o in ((reference, opt_ref), (lg.run_sequential, opt)):
            o.zero_grad()
            torch.manual_seed(step)
            out = tensor_leaves(fn(*inputs))[0]
            (out.double() ** 2).mean().backward()
            o.step()
    for (n, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        err = (p - q).abs().max().item() / max(q.abs().max().item(), 1e-300)
        assert err <= 1e-10, f"{n} drifted after 3 steps: {err:.3e}"
    for (n, b), (_, c) in zip(model.named_buffers(), reference.named_buffers()):
        assert torch.allclose(b, c, rtol=1e-10, atol=0), f"buffer {n} drifted after 3 steps"
