"""Verdicts on T5's family of encoder-decoders under `instrument()`'s defaults, over random models.

Each model is built from a small config with random weights (nothing is downloaded): 3 encoder and
4 decoder blocks, hidden 64, transformers' `initializer_factor` as given (Switch Transformers' router
weights have std `factor`: router logits of std about 8 at 1.0). A session runs a 12-token source
through the encoder, a 4-token decoder prompt and 3 cached decode steps, teacher-forced. The float32
model is the reference; the engine is its bfloat16 copy (an honest pair: every exit 1 is a false
divergence), or a float32 copy with one bug, a x1.01 scale of: decoder block 2's MLP (expected at
`layer2_mlp`), the same from the first decode step on (`layer2_mlp_step_1`), encoder block 1's MLP
(`encoder_output`), decoder block 1's cross-attention (`layer1_attn`). The table counts, per model
and case, the pairs whose verdict is the expected one (exit 0 for honest pairs; exit 1 at the
expected key for bugs), and prints the others.

Usage: python benchmarks/sweep_seq2seq.py [--models t5,mt5,umt5,longt5,pop2piano,switch] [--seeds 3]
       [--factors 0.1,0.3,1.0]
(about 6 minutes for the defaults on a 2-core CPU box; results in benchmarks/RESULTS.md).
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

VOCAB, SOURCE, PROMPT, STEPS = 160, 12, 4, 3
MODELS = {"t5": (T.T5Config, T.T5ForConditionalGeneration), "mt5": (T.MT5Config, T.MT5ForConditionalGeneration),
          "umt5": (T.UMT5Config, T.UMT5ForConditionalGeneration),
          "longt5": (T.LongT5Config, T.LongT5ForConditionalGeneration),
          "pop2piano": (T.Pop2PianoConfig, T.Pop2PianoForConditionalGeneration),
          "switch": (T.SwitchTransformersConfig, T.SwitchTransformersForConditionalGeneration)}
CASES = {"honest bf16": None, "decoder MLP": "layer2_mlp", "decode-only MLP": "layer2_mlp_step_1",
         "encoder MLP": "encoder_output", "cross-attention": "layer1_attn"}


def build(name: str, seed: int, factor: float) -> torch.nn.Module:
    config_class, model_class = MODELS[name]
    extra = dict(num_experts=8, num_sparse_decoder_layers=2, num_sparse_encoder_layers=3) if name == "switch" else {}
    config = config_class(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=96, num_layers=3, num_decoder_layers=4,
                          num_heads=4, pad_token_id=0, eos_token_id=2, decoder_start_token_id=0,
                          initializer_factor=factor, **extra)
    torch.manual_seed(seed)
    return model_class(config).eval()


def session(model, seed: int):
    generator = torch.Generator().manual_seed(seed)
    source = torch.randint(3, VOCAB, (1, SOURCE), generator=generator)
    prompt = torch.randint(3, VOCAB, (1, PROMPT), generator=generator)
    steps = torch.randint(3, VOCAB, (STEPS,), generator=generator)

    def run():
        encoded = model.get_encoder()(input_ids=source)
        out = model(encoder_outputs=encoded, decoder_input_ids=prompt, use_cache=True)
        for token in steps:
            out = model(encoder_outputs=encoded, decoder_input_ids=token.view(1, 1), cache=out.cache, use_cache=True)
    return run


def engine_for(reference: torch.nn.Module, case: str) -> torch.nn.Module:
    if case == "honest bf16":
        return copy.deepcopy(reference).to(torch.bfloat16)
    engine = copy.deepcopy(reference)
    if case in ("decoder MLP", "decode-only MLP"):
        feed_forward = engine.decoder.block[2].layer[2]
        module = getattr(feed_forward, "mlp", None) or feed_forward.DenseReluDense
    elif case == "encoder MLP":
        feed_forward = engine.encoder.block[1].layer[-1]
        module = getattr(feed_forward, "mlp", None) or feed_forward.DenseReluDense
    else:
        module = engine.decoder.block[1].layer[1].EncDecAttention
    scale_output(module, unless=(lambda args: args[0].shape[1] != 1) if case == "decode-only MLP" else None)
    return engine


def main() -> None:
    sweep_main(__doc__, MODELS, "factor", "factors", "0.1,0.3,1.0", build, session,
               lambda reference, case, _name: engine_for(reference, case), lambda _name: CASES, CASES)


if __name__ == "__main__":
    main()
