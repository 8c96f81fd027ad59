"""The Llama-style decoder of ``models/llama.py``: its presets are the published models' sizes, it
computes what Hugging Face's ``LlamaForCausalLM`` computes (same names, same logits), it trains
through Harmony as eagerly (float64, 2 emulated devices below a third of its footprint, pp and
dp), and its 8B preset decomposes and plans analytically."""

from __future__ import annotations

import copy
import functools

import pytest
import torch

import harmony
from harmony.models import llama
from harmony.models.common import count_parameters
from harmony.profiling.analytic import analytic_profile
from harmony.profiling.sweep import training_footprint
from harmony.runtime.reference import microbatches_of, reference_train
from harmony.scheduler.machine import Machine
from harmony.scheduler.search import search

# Hugging Face's counts of the same shapes: Llama 3.2 1B and 3B (tied embeddings), Llama 2 7B, Llama 3 8B
PARAM_COUNTS = {"tiny": 24_736, "1b": 1_235_814_400, "3b": 3_212_749_824, "7b": 6_738_415_616,
                "8b": 8_030_261_248}
MINIBATCH = 8


def hf_config(config: llama.LlamaConfig, attention: str = "sdpa"):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=config.vocab_size, hidden_size=config.dim, intermediate_size=config.ffn_hidden,
                       num_hidden_layers=config.n_layer, num_attention_heads=config.n_head,
                       num_key_value_heads=config.n_kv_head, max_position_embeddings=config.block_size,
                       rope_theta=config.rope_theta, rms_norm_eps=config.norm_eps,
                       tie_word_embeddings=config.tie_embeddings, attn_implementation=attention)


@pytest.mark.parametrize("preset", sorted(llama.PRESETS))
def test_every_preset_has_the_published_models_parameter_count(preset):
    with torch.device("meta"):
        model = llama.build_model(preset)
    assert count_parameters(model) == PARAM_COUNTS[preset]


def test_the_tiny_preset_uses_grouped_query_attention_and_tied_presets_share_one_matrix():
    assert llama.PRESETS["tiny"].n_kv_head < llama.PRESETS["tiny"].n_head
    with torch.device("meta"):
        tied = llama.build_model("1b")
    assert tied.lm_head.weight is tied.model.embed_tokens.weight


def test_logits_equal_hugging_face_llama_with_the_same_weights():
    """Bit for bit against Hugging Face's sdpa attention (the same scaled_dot_product_attention
    call); to rounding against its eager attention, which writes the scores out."""
    from transformers import LlamaForCausalLM

    config = llama.PRESETS["tiny"]
    torch.manual_seed(0)
    ours = llama.build_model("tiny")
    tokens, _ = llama.get_batch(3, 0)
    for attention in ("sdpa", "eager"):
        theirs = LlamaForCausalLM(hf_config(config, attention))
        theirs.load_state_dict(ours.state_dict(), strict=True)  # the same names, every one
        with torch.no_grad():
            if attention == "sdpa":
                assert torch.equal(ours(tokens), theirs(tokens).logits)
            else:
                torch.testing.assert_close(ours(tokens), theirs(tokens).logits, rtol=1e-5, atol=1e-6)


def test_rotary_embeddings_make_the_output_depend_on_the_order_of_the_context():
    """Without position information, causal attention sees its prefix as a set: swapping two
    earlier tokens would leave the last position's output unchanged."""
    torch.manual_seed(0)
    model = llama.build_model("tiny", dtype="float64")
    tokens = torch.tensor([[3, 7, 11, 5]])
    swapped = torch.tensor([[7, 3, 11, 5]])
    with torch.no_grad():
        assert not torch.allclose(model(tokens)[0, -1], model(swapped)[0, -1])


@functools.lru_cache(maxsize=None)
def compiled():
    torch.manual_seed(0)
    model = llama.build_model("tiny", dtype="float64")
    get_batch = functools.partial(llama.get_batch, preset="tiny", dtype="float64")
    graph = harmony.decompose(model, get_batch(2, 0)[0])
    capacity = int(0.3 * training_footprint(graph, get_batch, MINIBATCH))
    return model, get_batch, capacity


@pytest.mark.parametrize("mode", ["pp", "dp"])
def test_the_tiny_llama_trains_through_harmony_as_eagerly(mode):
    model, get_batch, capacity = compiled()
    plan = harmony.compile(model, llama.loss_fn, get_batch, minibatch_size=MINIBATCH, devices=2,
                           device_memory=capacity, mode=mode, build_optimizer=llama.build_optimizer, probe=False)
    reference = copy.deepcopy(model)
    batches = [get_batch(MINIBATCH, step) for step in range(3)]
    with harmony.Trainer(plan, timeout=30) as trainer:
        losses = [trainer.step(x, y) for x, y in batches]
        state = trainer.state_dict()
    expected = reference_train(reference, llama.loss_fn, llama.build_optimizer, batches, microbatches_of(plan.tasks))
    assert losses == pytest.approx(expected, rel=1e-9)
    for name, want in reference.state_dict().items():
        scale = float(want.abs().max().clamp_min(1e-3))
        assert float((state[name] - want).abs().max()) / scale <= 1e-9, name
    assert plan.options["device_memory"] * 3 < training_footprint(plan.graph, get_batch, MINIBATCH)


def test_the_8b_preset_decomposes_on_meta_and_plans_analytically_on_h100s():
    with torch.device("meta"):
        model = llama.build_model("8b")
    graph = harmony.decompose(model, llama.get_batch(1, 0, preset="8b")[0])
    assert len(graph.layers) == 32 + 3 and graph.layers[1].name == "model.layers.0"
    profile = analytic_profile(graph, "h100", max_microbatch=4)
    result = search(profile, Machine.from_spec("h100", 4), "pp", 4, 4)
    assert result.estimate.fits and result.estimate.iteration_time > 0
