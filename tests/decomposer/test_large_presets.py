"""The paper's large models decompose on the meta device (no memory, no data) in seconds."""

from __future__ import annotations

import time

import pytest
import torch

import harmony
from harmony.models import bert, gpt2, resnet

TIME_LIMIT_S = 60.0


def _decompose_on_meta(module, preset: str):
    start = time.perf_counter()
    with torch.device("meta"):
        model = module.build_model(preset=preset)
    inputs, _ = module.get_batch(1, 0, preset=preset)
    lg = harmony.decompose(model, (inputs,))
    elapsed = time.perf_counter() - start
    assert elapsed < TIME_LIMIT_S, f"{module.__name__} {preset}: building and decomposing took {elapsed:.1f} s"
    assert all(p.device.type == "meta" for p in model.parameters())
    return model, inputs, lg


def _param_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())  # tied parameters once


def _assert_plausible(lg, model, inputs):
    assert lg.parameter_bytes() == _param_bytes(model)
    for a, b in zip(lg.layers, lg.layers[1:]):
        assert a.outputs == b.inputs
    assert lg.values[lg.inputs[0]].shape == list(inputs.shape)
    assert all(spec.state for spec in lg.layers), "every layer of these models has parameters"


@pytest.mark.slow
def test_gpt2_10b_decomposes_on_meta_into_blocks_plus_embedding_and_head():
    model, inputs, lg = _decompose_on_meta(gpt2, "10b")
    n_layer = gpt2.PRESETS["10b"].n_layer
    assert len(lg) == n_layer + 2
    assert [s.name for s in lg.layers[1:-1]] == [f"h.{i}" for i in range(n_layer)]
    assert lg.ties == {"wte.weight": ["lm_head.weight"]}
    _assert_plausible(lg, model, inputs)
    assert lg.parameter_bytes() > 40e9  # ~10.3B float32 parameters
    hidden = lg.values[lg.layers[1].outputs[0]]
    assert hidden.shape == [1, gpt2.PRESETS["10b"].block_size, gpt2.PRESETS["10b"].n_embd]


@pytest.mark.slow
def test_bert_96_decomposes_on_meta_into_96_layers_plus_embedding_and_head():
    model, inputs, lg = _decompose_on_meta(bert, "96")
    assert len(lg) == 96 + 2
    assert [s.name for s in lg.layers[1:-1]] == [f"encoder.{i}" for i in range(96)]
    _assert_plausible(lg, model, inputs)


@pytest.mark.slow
def test_resnet1k_decomposes_on_meta_into_one_layer_per_block():
    model, inputs, lg = _decompose_on_meta(resnet, "resnet1k")
    config = resnet.PRESETS["resnet1k"]
    n_blocks = config.blocks_per_stage * len(config.widths)
    assert len(lg) == n_blocks + 2  # stem conv, the bottleneck blocks, the final BN-ReLU-pool-fc
    _assert_plausible(lg, model, inputs)
    assert lg.layer_buffers(1), "batch-norm running statistics belong to the layers"
