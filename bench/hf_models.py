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

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from bench import outside
from bench.outside import Case

VOCAB, SEQ, MINIBATCH = 128, 32, 16


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


COLLECTION = outside.Collection(CASES, MINIBATCH, "transformers", "bench.hf_models", __doc__)
run, table, markdown = COLLECTION.run, COLLECTION.table, outside.markdown
main = COLLECTION.main


if __name__ == "__main__":
    main()
