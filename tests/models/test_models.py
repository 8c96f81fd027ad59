"""Tests of the reference models in ``harmony.models``: shapes, gradients, presets, tracing, loading.

Everything runs on the tiny presets, except that every preset is built on the meta device (no
memory) to check its parameter count against the count documented in the model file.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import harmony
from harmony.modelfile import load_model_file
from harmony.models import bert, gpt2, resnet, vgg
from harmony.models.common import count_parameters
from harmony.profiling.sweep import training_footprint
from harmony.runtime.reference import microbatches_of, reference_train

MODELS = {"gpt2": gpt2, "bert": bert, "vgg": vgg, "resnet": resnet}
MODEL_DIR = Path(gpt2.__file__).parent

# The counts written next to each preset (tied weights counted once). GPT-2 medium and BERT-large
# equal Hugging Face's GPT2LMHeadModel / BertForMaskedLM of the same shape.
PARAM_COUNTS = {
    ("gpt2", "tiny"): 41_760,
    ("gpt2", "medium"): 354_823_168,
    ("gpt2", "large"): 774_030_080,
    ("gpt2", "1.5b"): 1_557_611_200,
    ("gpt2", "10b"): 10_279_047_168,
    ("gpt2", "20b"): 20_555_431_936,
    ("gpt2", "40b"): 40_690_753_536,
    ("bert", "tiny"): 22_016,
    ("bert", "large"): 335_174_458,
    ("bert", "96"): 1_242_102_586,
    ("vgg", "tiny"): 22_362,
    ("vgg", "vgg416"): 577_894_184,
    ("resnet", "tiny"): 8_946,
    ("resnet", "resnet1k"): 10_605_914,
}
# Nominal sizes the preset names promise, to +-5%.
NOMINAL = {
    ("gpt2", "medium"): 0.35e9,
    ("gpt2", "large"): 0.774e9,
    ("gpt2", "1.5b"): 1.5e9,
    ("gpt2", "10b"): 10e9,
    ("gpt2", "20b"): 20e9,
    ("gpt2", "40b"): 40e9,
    ("bert", "large"): 3.35e8,
}

ALL_PRESETS = [(name, preset) for name, mod in MODELS.items() for preset in mod.PRESETS]


def tiny(name: str, dtype: str = "float32", dropout: float | None = 0.0) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[name].build_model(preset="tiny", dtype=dtype, dropout=dropout)


def test_presets_table_is_complete():
    assert set(PARAM_COUNTS) == set(ALL_PRESETS)
    assert set(gpt2.PRESETS) == {"tiny", "medium", "large", "1.5b", "10b", "20b", "40b"}
    assert set(bert.PRESETS) == {"tiny", "large", "96"}
    assert set(vgg.PRESETS) == {"tiny", "vgg416"}
    assert set(resnet.PRESETS) == {"tiny", "resnet1k"}


@pytest.mark.parametrize("name", MODELS)
def test_tiny_forward_shape_and_finite_loss(name):
    mod = MODELS[name]
    model = tiny(name)
    x, y = mod.get_batch(4, 0, preset="tiny")
    out = model(x)
    if name in ("gpt2", "bert"):
        vocab = model.config.vocab_size
        assert out.shape == (*x.shape, vocab)
        assert y.shape == x.shape
    else:
        assert out.shape == (4, model.config.num_classes)
        assert y.shape == (4,)
    loss = mod.loss_fn(out, y)
    assert loss.dim() == 0 and torch.isfinite(loss)


@pytest.mark.parametrize("name", MODELS)
def test_backward_reaches_every_parameter(name):
    mod = MODELS[name]
    model = tiny(name, dropout=None)
    model.train()
    x, y = mod.get_batch(4, 1, preset="tiny")
    mod.loss_fn(model(x), y).backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None, pname
        assert torch.isfinite(p.grad).all(), pname
        assert p.grad.abs().sum() > 0, pname


@pytest.mark.parametrize("name", MODELS)
def test_loss_is_mean_over_samples(name):
    """loss(batch) == mean of per-sample losses, which Harmony's u/D microbatch scaling assumes."""
    mod = MODELS[name]
    model = tiny(name, dtype="float64").eval()
    x, y = mod.get_batch(4, 2, preset="tiny", dtype="float64")
    whole = mod.loss_fn(model(x), y)
    parts = torch.stack([mod.loss_fn(model(x[i:i + 1]), y[i:i + 1]) for i in range(4)])
    torch.testing.assert_close(whole, parts.mean())


@pytest.mark.parametrize("name", MODELS)
def test_get_batch_is_deterministic(name):
    mod = MODELS[name]
    x1, y1 = mod.get_batch(3, 5, preset="tiny")
    x2, y2 = mod.get_batch(3, 5, preset="tiny")
    torch.testing.assert_close(x1, x2, rtol=0, atol=0)
    torch.testing.assert_close(y1, y2, rtol=0, atol=0)
    x3, _ = mod.get_batch(3, 6, preset="tiny")
    assert not torch.equal(x1, x3)
    # the first rows of a bigger batch need not match, but the batch is still reproducible
    torch.testing.assert_close(mod.get_batch(5, 5, preset="tiny")[0],
                               mod.get_batch(5, 5, preset="tiny")[0], rtol=0, atol=0)
    assert y1.dtype == torch.long
    if name in ("gpt2", "bert"):
        assert x1.dtype == torch.long
        assert int(x1.min()) >= 0 and int(x1.max()) < mod.PRESETS["tiny"].vocab_size
    else:
        assert x1.dtype == torch.float32
        assert mod.get_batch(3, 5, preset="tiny", dtype="float64")[0].dtype == torch.float64
        assert int(y1.max()) < mod.PRESETS["tiny"].num_classes


@pytest.mark.parametrize("name", MODELS)
def test_float64(name):
    mod = MODELS[name]
    model = tiny(name, dtype="float64")
    assert all(p.dtype == torch.float64 for p in model.parameters())
    x, y = mod.get_batch(2, 0, preset="tiny", dtype="float64")
    assert model(x).dtype == torch.float64


@pytest.mark.parametrize("name", MODELS)
def test_init_is_deterministic_under_manual_seed(name):
    a, b = tiny(name).state_dict(), tiny(name).state_dict()
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)


@pytest.mark.parametrize("name,preset", ALL_PRESETS)
def test_every_preset_builds_on_meta_with_documented_size(name, preset):
    start = time.perf_counter()
    with torch.device("meta"):
        model = MODELS[name].build_model(preset=preset)
    assert time.perf_counter() - start < 30
    assert all(p.is_meta for p in model.parameters())
    n = count_parameters(model)
    assert n == PARAM_COUNTS[(name, preset)]
    if (name, preset) in NOMINAL:
        assert abs(n / NOMINAL[(name, preset)] - 1) < 0.05


def test_preset_given_as_number():
    """``--arg preset=96`` is parsed as the integer 96."""
    with torch.device("meta"):
        assert len(bert.build_model(preset=96).encoder) == 96


def test_unknown_preset_is_named():
    with pytest.raises(ValueError, match="no preset 'huge'"):
        gpt2.build_model(preset="huge")


def test_depths_of_the_deep_cnns():
    with torch.device("meta"):
        v = vgg.build_model(preset="vgg416")
        r = resnet.build_model(preset="resnet1k")
    convs = sum(isinstance(m, nn.Conv2d) for m in v.modules())
    fcs = sum(isinstance(m, nn.Linear) for m in v.modules())
    assert (convs, fcs) == (413, 3) and v.config.num_weight_layers == 416
    assert all(len(stage) == d + 1 for stage, d in zip(v.features, v.config.depths))  # + pool
    projections = 3  # the 1x1 shortcut convs, not counted in a ResNet's depth
    weight_layers = sum(isinstance(m, (nn.Conv2d, nn.Linear)) for m in r.modules()) - projections
    assert weight_layers == r.config.depth == 9 * 114 + 2
    assert sum(isinstance(m, nn.BatchNorm2d) for m in r.modules()) == 3 * 3 * 114 + 1


def test_transformer_depths_and_widths():
    with torch.device("meta"):
        g = gpt2.build_model(preset="1.5b")
        b = bert.build_model(preset="large")
    assert len(g.h) == 48 and g.wte.weight.shape == (50257, 1600) and g.config.block_size == 1024
    assert len(b.encoder) == 24 and b.embeddings.word_embeddings.weight.shape == (30522, 1024)
    assert b.config.max_position == 512


def test_tied_weights_are_one_parameter():
    g = tiny("gpt2")
    assert g.lm_head.weight is g.wte.weight
    names = [n for n, _ in g.named_parameters()]
    assert "wte.weight" in names and "lm_head.weight" not in names
    b = tiny("bert")
    assert b.cls.decoder.weight is b.embeddings.word_embeddings.weight
    with torch.device("meta"):
        big = gpt2.build_model(preset="40b")
    assert big.lm_head.weight is big.wte.weight


def test_bert_attends_to_no_padding():
    """Padding tokens change no other position's logits; a mask of ones is no mask."""
    model = tiny("bert", dtype="float64").eval()
    x, _ = bert.get_batch(3, 0, preset="tiny")
    mask = padding_mask(x)
    other = torch.where(mask.bool(), x, (x + 1) % model.config.vocab_size)
    assert not torch.equal(other, x)
    keep = mask.bool()
    torch.testing.assert_close(model(x, mask)[keep], model(other, mask)[keep], rtol=0, atol=0)
    assert not torch.allclose(model(x)[keep], model(other)[keep])
    torch.testing.assert_close(model(x, torch.ones_like(x)), model(x), rtol=0, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["pp", "dp"])
def test_bert_with_a_padding_mask_trains_through_harmony_as_eagerly(mode):
    """The mask is a second model input every layer reads: float64, 2 emulated devices below a
    third of the footprint, losses and weights after 3 steps equal eager's."""
    def get_batch(n: int, step: int):
        ids, target = bert.get_batch(n, step, preset="tiny")
        return (ids, padding_mask(ids)), target

    model = tiny("bert", dtype="float64", dropout=None)
    graph = harmony.decompose(model, get_batch(2, 0)[0])
    capacity = int(0.3 * training_footprint(graph, get_batch, 8))
    plan = harmony.compile(model, bert.loss_fn, get_batch, minibatch_size=8, devices=2, device_memory=capacity,
                           mode=mode, build_optimizer=bert.build_optimizer, probe=False)
    reference = copy.deepcopy(model)
    batches = [get_batch(8, step) for step in range(3)]
    with harmony.Trainer(plan, timeout=30) as trainer:
        losses = [trainer.step(x, y) for x, y in batches]
        state = trainer.state_dict()
    expected = reference_train(reference, bert.loss_fn, bert.build_optimizer, batches, microbatches_of(plan.tasks))
    assert losses == pytest.approx(expected, rel=1e-9)
    for name, want in reference.state_dict().items():
        assert float((state[name] - want).abs().max()) <= 1e-9 * float(want.abs().max().clamp_min(1e-3)), name


def test_gpt2_is_causal():
    """Changing a later token must not change the logits of earlier positions."""
    model = tiny("gpt2", dtype="float64").eval()
    x, _ = gpt2.get_batch(2, 0, preset="tiny")
    x2 = x.clone()
    x2[:, 10:] = (x2[:, 10:] + 1) % model.config.vocab_size
    torch.testing.assert_close(model(x)[:, :10], model(x2)[:, :10])
    assert not torch.allclose(model(x)[:, 10:], model(x2)[:, 10:])


@pytest.mark.parametrize("name", MODELS)
def test_dropout_option(name):
    def rates(model):
        return {m.p for m in model.modules() if isinstance(m, nn.Dropout)}

    default = {"gpt2": {0.1}, "bert": {0.1}, "vgg": {0.5}, "resnet": set()}[name]
    assert rates(tiny(name, dropout=None)) == default
    assert rates(tiny(name, dropout=0.0)) <= {0.0}


def test_resnet_has_batchnorm_buffers_that_train_updates():
    model = tiny("resnet").train()
    buffers = {n for n, _ in model.named_buffers()}
    assert "stages.0.0.bn1.running_mean" in buffers and "bn.num_batches_tracked" in buffers
    before = model.bn.running_mean.clone()
    model(resnet.get_batch(4, 0, preset="tiny")[0])
    assert not torch.equal(before, model.bn.running_mean)
    assert int(model.bn.num_batches_tracked) == 1


def padding_mask(ids: torch.Tensor) -> torch.Tensor:
    """Hugging Face's attention mask for ``ids`` whose sample i ends in i (mod the length) padding tokens."""
    mask = torch.ones_like(ids)
    for i in range(ids.size(0)):
        mask[i, ids.size(1) - i % ids.size(1):] = 0
    return mask


@pytest.mark.parametrize("name", MODELS)
def test_fx_symbolic_trace_reproduces_output(name):
    mod = MODELS[name]
    model = tiny(name, dtype="float64").eval()
    traced = torch.fx.symbolic_trace(model)
    x, _ = mod.get_batch(3, 0, preset="tiny", dtype="float64")
    args = (x, padding_mask(x)) if name == "bert" else (x,)  # BERT's padding mask traced as an input
    torch.testing.assert_close(traced(*args), model(*args), rtol=0, atol=0)
    if name == "gpt2":  # the tie survives tracing
        assert traced.lm_head.weight is traced.wte.weight


@pytest.mark.parametrize("name", MODELS)
def test_loads_as_model_file(name):
    mf = load_model_file(MODEL_DIR / f"{name}.py", {"preset": "tiny", "dtype": "float64"})
    torch.manual_seed(0)
    model = mf.build_model()
    x, y = mf.get_batch(2, 0)
    assert x.dtype == (torch.long if name in ("gpt2", "bert") else torch.float64)
    loss = mf.loss_fn(model(x), y)
    loss.backward()
    opt = mf.build_optimizer(model.parameters())
    assert isinstance(opt, torch.optim.Optimizer)
    opt.step()


@pytest.mark.parametrize("name", MODELS)
def test_a_few_steps_reduce_the_loss(name):
    """The synthetic data is learnable and the default optimizers make progress on it."""
    mod = MODELS[name]
    model = tiny(name)
    lr = {"gpt2": 3e-3, "bert": 3e-3, "vgg": 0.01, "resnet": 0.05}[name]
    opt = mod.build_optimizer(model.parameters(), lr=lr)
    losses = []
    for step in range(12):
        x, y = mod.get_batch(16, step % 2, preset="tiny")
        loss = mod.loss_fn(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-2:]) < sum(losses[:2])


# ---- reference check against an implementation that shares no code with ours -----------------


@pytest.mark.slow
def test_gpt2_matches_huggingface():
    transformers = pytest.importorskip("transformers")
    model = tiny("gpt2", dtype="float64").eval()
    c = model.config
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=c.vocab_size, n_positions=c.block_size, n_embd=c.n_embd, n_layer=c.n_layer,
        n_head=c.n_head, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        activation_function="gelu_new", bos_token_id=0, eos_token_id=0,
    )).double().eval()
    state = {}
    for k, v in model.state_dict().items():
        if k.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight")):
            v = v.t()  # HF's Conv1D stores (in, out)
        state[k if k.startswith("lm_head") else "transformer." + k] = v
    hf.load_state_dict(state)
    x, _ = gpt2.get_batch(2, 0, preset="tiny")
    torch.testing.assert_close(model(x), hf(x).logits)


@pytest.mark.slow
def test_bert_matches_huggingface():
    transformers = pytest.importorskip("transformers")
    model = tiny("bert", dtype="float64").eval()
    c = model.config
    hf = transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden, num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads, intermediate_size=c.intermediate,
        max_position_embeddings=c.max_position, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, pad_token_id=0,
    )).double().eval()
    layer_names = {
        "attention.query": "attention.self.query", "attention.key": "attention.self.key",
        "attention.value": "attention.self.value", "attention.output": "attention.output.dense",
        "attention_norm": "attention.output.LayerNorm", "intermediate": "intermediate.dense",
        "output": "output.dense", "output_norm": "output.LayerNorm",
    }
    head_names = {
        "transform": "predictions.transform.dense", "LayerNorm": "predictions.transform.LayerNorm",
        "decoder": "predictions.decoder",
    }
    state = {}
    for k, v in model.state_dict().items():
        prefix, _, leaf = k.rpartition(".")
        if k.startswith("encoder."):
            _, i, sub = prefix.split(".", 2)
            state[f"bert.encoder.layer.{i}.{layer_names[sub]}.{leaf}"] = v
        elif k.startswith("embeddings."):
            state["bert." + k] = v
        else:
            state[f"cls.{head_names[prefix.split('.', 1)[1]]}.{leaf}"] = v
    state["cls.predictions.bias"] = state["cls.predictions.decoder.bias"]
    hf.load_state_dict(state, strict=False)
    x, _ = bert.get_batch(3, 0, preset="tiny")
    torch.testing.assert_close(model(x), hf(x).logits)
    mask = padding_mask(x)  # the padding mask, as HF's sdpa attention takes it
    torch.testing.assert_close(model(x, mask), hf(x, attention_mask=mask).logits)
