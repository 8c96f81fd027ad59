"""Hugging Face models Harmony's own tests did not write, trained against eager PyTorch.

Each architecture is built tiny, in float64, from its *default* configuration (``use_cache`` on,
dropout set to 0 so that eager and Harmony draw nothing), compiled at a third of its training
footprint on two emulated devices, and trained two steps in pp and in dp. The row says how far the
losses and parameters are from eager's on the same microbatches, and whether every device stayed
within its capacity. An architecture that fails shows its error.

    python -m bench.hf_models [--models qwen2,falcon] [--modes pp,dp] [--json out.json]

Needs ``transformers``. Runs take 4-15 s each on two cores.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from typing import Any, Callable

import torch
from rich.console import Console
from rich.table import Table
from torch import nn

import harmony
from harmony.profiling.sweep import training_footprint
from harmony.runtime.reference import microbatches_of, reference_train

VOCAB, SEQ, MINIBATCH, DEVICES, STEPS = 128, 32, 16, 2, 2
Case = tuple[Callable[[], nn.Module], Callable[[int, int], tuple], Callable]


def adam(params):
    return torch.optim.Adam(params, lr=1e-3, eps=1e-6)


def _tokens(b: int, step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (b, SEQ), generator=torch.Generator().manual_seed(step))


def _causal(cls_name: str, config_name: str, **config: Any) -> Case:
    import transformers

    def build() -> nn.Module:
        torch.manual_seed(0)
        return getattr(transformers, cls_name)(getattr(transformers, config_name)(**config)).double()

    def loss(out, target):
        return nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, VOCAB), target[:, 1:].reshape(-1))

    return build, lambda b, step: (_tokens(b, step), _tokens(b, step)), loss


def _classifier(cls_name: str, config_name: str, **config: Any) -> Case:
    import transformers

    def build() -> nn.Module:
        torch.manual_seed(0)
        return getattr(transformers, cls_name)(getattr(transformers, config_name)(num_labels=3, **config)).double()

    def batch(b: int, step: int) -> tuple:
        g = torch.Generator().manual_seed(step)
        return torch.randint(3, VOCAB, (b, SEQ), generator=g), torch.randint(0, 3, (b,), generator=g)

    return build, batch, lambda out, target: nn.functional.cross_entropy(out.logits, target)


def _vit() -> Case:
    build, _, loss = _classifier("ViTForImageClassification", "ViTConfig", image_size=16, patch_size=4,
                                 hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=64,
                                 hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)

    def batch(b: int, step: int) -> tuple:
        g = torch.Generator().manual_seed(step)
        return torch.randn(b, 3, 16, 16, generator=g, dtype=torch.float64), torch.randint(0, 3, (b,), generator=g)

    return build, batch, loss


def _bart() -> Case:
    """BART's classification head picks each sample's last end token with a mask (one per sample)."""
    build, _, loss = _classifier("BartForSequenceClassification", "BartConfig", vocab_size=VOCAB, d_model=64,
                                 encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                                 decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
                                 max_position_embeddings=64, dropout=0.0, pad_token_id=1, eos_token_id=2)

    def batch(b: int, step: int) -> tuple:
        g = torch.Generator().manual_seed(step)
        tokens = torch.randint(3, VOCAB, (b, SEQ), generator=g)
        tokens[:, -1] = 2
        return tokens, torch.randint(0, 3, (b,), generator=g)

    return build, batch, loss


_LM = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
           max_position_embeddings=64)
_ENCODER = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
CASES: dict[str, Callable[[], Case]] = {
    "llama": lambda: _causal("LlamaForCausalLM", "LlamaConfig", **_LM, num_key_value_heads=2),
    "qwen2": lambda: _causal("Qwen2ForCausalLM", "Qwen2Config", **_LM, num_key_value_heads=2, tie_word_embeddings=True),
    "mistral": lambda: _causal("MistralForCausalLM", "MistralConfig", **_LM, num_key_value_heads=2, sliding_window=16),
    "gemma": lambda: _causal("GemmaForCausalLM", "GemmaConfig", **_LM, num_key_value_heads=2, head_dim=16),
    "phi": lambda: _causal("PhiForCausalLM", "PhiConfig", **_LM, resid_pdrop=0.0, embd_pdrop=0.0),
    "gpt_neox": lambda: _causal("GPTNeoXForCausalLM", "GPTNeoXConfig", **_LM, hidden_dropout=0.0),
    "gpt2": lambda: _causal("GPT2LMHeadModel", "GPT2Config", n_layer=3, n_embd=64, n_head=4, vocab_size=VOCAB,
                            n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    "gptj": lambda: _causal("GPTJForCausalLM", "GPTJConfig", vocab_size=VOCAB, n_embd=64, n_layer=3, n_head=4,
                            n_positions=64, rotary_dim=8, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    "opt": lambda: _causal("OPTForCausalLM", "OPTConfig", vocab_size=VOCAB, hidden_size=64, ffn_dim=128,
                           num_hidden_layers=3, num_attention_heads=4, max_position_embeddings=64, dropout=0.0,
                           word_embed_proj_dim=64),
    "bloom": lambda: _causal("BloomForCausalLM", "BloomConfig", vocab_size=VOCAB, hidden_size=64, n_layer=3, n_head=4),
    "falcon": lambda: _causal("FalconForCausalLM", "FalconConfig", vocab_size=VOCAB, hidden_size=64,
                              num_hidden_layers=3, num_attention_heads=4),
    "bert": lambda: _classifier("BertForSequenceClassification", "BertConfig", **_ENCODER),
    "roberta": lambda: _classifier("RobertaForSequenceClassification", "RobertaConfig", **_ENCODER, pad_token_id=1),
    "electra": lambda: _classifier("ElectraForSequenceClassification", "ElectraConfig", **_ENCODER, embedding_size=32),
    "albert": lambda: _classifier("AlbertForSequenceClassification", "AlbertConfig", **_ENCODER, embedding_size=32,
                                  classifier_dropout_prob=0.0),
    "distilbert": lambda: _classifier("DistilBertForSequenceClassification", "DistilBertConfig", vocab_size=VOCAB,
                                      dim=64, hidden_dim=128, n_layers=3, n_heads=4, max_position_embeddings=64,
                                      dropout=0.0, attention_dropout=0.0, seq_classif_dropout=0.0),
    "vit": _vit,
    "bart": _bart,
}


def run(name: str, mode: str) -> dict[str, Any]:
    """One architecture in one mode: the worst relative errors against eager, and the peaks."""
    start = time.perf_counter()
    row: dict[str, Any] = {"model": name, "mode": mode}
    try:
        build, get_batch, loss_fn = CASES[name]()
        model = build()
        graph = harmony.decompose(copy.deepcopy(model), get_batch(2, 0)[0])
        capacity = training_footprint(graph, get_batch, MINIBATCH) // 3
        plan = harmony.compile(model, loss_fn, get_batch, minibatch_size=MINIBATCH, devices=DEVICES, mode=mode,
                               device_type="cpu", device_memory=capacity, build_optimizer=adam, probe=False)
        batches = [get_batch(MINIBATCH, step) for step in range(STEPS)]
        reference = copy.deepcopy(model)
        with harmony.Trainer(plan, optimizer=adam, timeout=120) as trainer:
            losses = [trainer.step(inputs, target) for inputs, target in batches]
            state = trainer.state_dict()
            peaks = [max(w.peak for w in step.workers) for step in trainer.history]
        expected = reference_train(reference, plan.loss_fn, adam, batches, microbatches_of(plan.tasks))
        row.update(config=str(plan.tasks.config), capacity=capacity, peak=max(peaks),
                   loss_error=max(abs(a - b) / abs(b) for a, b in zip(losses, expected)),
                   param_error=_worst_parameter(reference.state_dict(), state))
    except Exception as exc:  # noqa: BLE001 - a failing architecture is a row, not the end of the run
        row["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    row["seconds"] = time.perf_counter() - start
    return row


def _worst_parameter(want: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> float:
    worst = 0.0
    for name, w in want.items():
        if w.is_floating_point():
            scale = float(w.abs().max().clamp_min(1e-3))
            worst = max(worst, float((got[name].double() - w.double()).abs().max()) / scale)
    return worst


def table(rows: list[dict[str, Any]]) -> Table:
    out = Table(title=f"Hugging Face models against eager ({STEPS} steps, float64, {DEVICES} emulated devices, "
                      "a third of the training footprint each)")
    for col in ("model", "mode", "loss error", "parameter error", "peak / capacity", "s", "configuration or error"):
        out.add_column(col, justify="left" if col in ("model", "mode", "configuration or error") else "right")
    for r in rows:
        if "error" in r:
            out.add_row(r["model"], r["mode"], "-", "-", "-", f"{r['seconds']:.0f}", f"[red]{_short(r['error'])}[/]")
            continue
        out.add_row(r["model"], r["mode"], f"{r['loss_error']:.1e}", f"{r['param_error']:.1e}",
                    f"{r['peak'] / r['capacity']:.2f}", f"{r['seconds']:.0f}", r["config"])
    return out


def _short(error: str, limit: int = 110) -> str:
    return error if len(error) <= limit else error[: limit - 1] + "…"


def markdown(rows: list[dict[str, Any]], header: str) -> str:
    lines = [header, "", "| model | mode | loss error | parameter error | peak / capacity | configuration or error |",
             "|---|---|---:|---:|---:|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['mode']} | - | - | - | {_short(r['error'], 200)} |")
        else:
            lines.append(f"| {r['model']} | {r['mode']} | {r['loss_error']:.1e} | {r['param_error']:.1e} | "
                         f"{r['peak'] / r['capacity']:.2f} | {r['config']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(CASES), help=f"comma-separated, of: {', '.join(CASES)}")
    parser.add_argument("--modes", default="pp,dp", help="comma-separated modes (default: pp,dp)")
    parser.add_argument("--json", help="also write the rows here")
    parser.add_argument("--markdown", help="also write the table here, as markdown")
    ns = parser.parse_args(argv)
    unknown = [m for m in ns.models.split(",") if m not in CASES]
    if unknown:
        parser.error(f"unknown models: {', '.join(unknown)}")
    rows = [run(name, mode) for name in ns.models.split(",") for mode in ns.modes.split(",")]
    Console().print(table(rows))
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(rows, f, indent=1)
    if ns.markdown:
        import transformers

        header = (f"torch {torch.__version__}, transformers {transformers.__version__}: `python -m bench.hf_models` "
                  f"({STEPS} steps, float64, {DEVICES} emulated devices at a third of the training footprint; errors "
                  "relative to eager on the same microbatches)")
        with open(ns.markdown, "w") as f:
            f.write(markdown(rows, header))


if __name__ == "__main__":
    main()
