"""Verdicts on BERT's family as decoders (and CTRL) under `instrument()`'s defaults, over random models.

Each model is a transformers causal LM built from a small config with random weights (nothing is
downloaded): 4 layers, hidden 64, `initializer_range` as given (transformers' default for these is
0.02). A session feeds a 6-token prompt, then 3 teacher-forced tokens, each forward over the whole
sequence (no cache), so that `logits_<n>` and `layer<i>_step_<n>` hold each forward's last position.
The float32 model is the reference; the engine is its bfloat16 copy (an honest pair: every exit 1
is a false divergence), or a float32 copy with a x1.01 scale of: layer 2's MLP (`output.dense`,
CTRL's `ffn`; expected at `layer2_mlp`), layer 1's attention (`attention.self`, CTRL's
`multi_head_attention`; `layer1_attn`), layer 2's MLP from the first decode step on
(`layer2_mlp_step_1`). The table counts, per model and case, the pairs whose verdict is the expected
one, and prints the others.

Usage: python benchmarks/sweep_bert.py [--models bert,roberta,...] [--seeds 3] [--inits 0.02,0.1]
(about 4 minutes for the defaults on a 2-core CPU box; results in benchmarks/RESULTS.md).
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch
import transformers as T

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from harness import sweep_main  # noqa: E402
from helpers.hf_dump import scale_output  # noqa: E402  (the tests' planted bug)

VOCAB, PROMPT, STEPS, LAYERS = 160, 6, 3, 4
MODELS = ("bert", "bert-generation", "big_bird", "camembert", "data2vec-text", "electra", "ernie", "megatron-bert",
          "rembert", "roberta", "roberta-prelayernorm", "roc_bert", "roformer", "xlm-roberta", "xlm-roberta-xl",
          "xmod", "ctrl")
SIZES = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=LAYERS, num_attention_heads=4, intermediate_size=96,
             pad_token_id=0, bos_token_id=1, eos_token_id=2, max_position_embeddings=64, is_decoder=True)
CTRL = dict(vocab_size=VOCAB, n_embd=64, n_layer=LAYERS, n_head=4, dff=96, n_positions=64)
EXTRA = {"rembert": dict(input_embedding_size=64, output_embedding_size=64),
         "big_bird": dict(attention_type="original_full"),
         "roc_bert": dict(pronunciation_vocab_size=VOCAB, shape_vocab_size=VOCAB)}
CASES = {"honest bf16": None, "MLP": "layer2_mlp", "attention": "layer1_attn", "decode-only MLP": "layer2_mlp_step_1"}


def build(model_type: str, seed: int, init: float) -> torch.nn.Module:
    sizes = CTRL if model_type == "ctrl" else SIZES
    config = T.AutoConfig.for_model(model_type, **sizes, **EXTRA.get(model_type, {}), initializer_range=init)
    torch.manual_seed(seed)
    model = T.AutoModelForCausalLM.from_config(config).eval()
    if model_type == "xmod":
        model.set_default_language(config.languages[0])  # (its adapters are per language)
    return model


def session(model, seed: int):
    ids = torch.randint(3, VOCAB, (1, PROMPT + STEPS), generator=torch.Generator().manual_seed(seed))

    def run():
        for end in range(PROMPT, PROMPT + STEPS + 1):
            model(input_ids=ids[:, :end], use_cache=False)
    return run


def engine_for(reference: torch.nn.Module, case: str) -> torch.nn.Module:
    if case == "honest bf16":
        return copy.deepcopy(reference).to(torch.bfloat16)
    engine = copy.deepcopy(reference)
    layers = engine.transformer.h if hasattr(engine, "transformer") else engine.base_model.encoder.layer
    if case == "attention":
        layer = layers[1]
        module = getattr(layer, "multi_head_attention", None) or layer.attention.self
    else:
        module = getattr(layers[2], "ffn", None) or layers[2].output.dense
    scale_output(module, unless=(lambda args: args[0].shape[1] == PROMPT) if case == "decode-only MLP" else None)
    return engine


def main() -> None:
    sweep_main(__doc__, MODELS, "init", "inits", "0.02,0.1", build, session,
               lambda reference, case, _name: engine_for(reference, case), lambda _name: CASES, CASES)


if __name__ == "__main__":
    main()
