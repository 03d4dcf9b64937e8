"""Verdicts on torchtitan's own Llama 3 under `instrument()`'s defaults (a reference that is not a
Hugging Face model: `tok_embeddings`, a `ModuleDict` of layers, `attention`, `feed_forward`,
`ffn_norm`, `norm`, `lm_head`).

torchtitan's `debugmodel` flavour (6 layers, dim 256, vocabulary 2048, flex attention; torchtitan's
own weight init, seeded), a 12-token prompt, then 3 teacher-forced tokens, each forward over the
whole sequence (torchtitan keeps no KV cache). The float32 model is the reference; the engine is its
bfloat16 copy (an honest pair: exit 1 is a false divergence) or a float32 copy with a x1.01 scale of
layer 3's feed-forward (expected at `layer3_mlp`), of layer 2's attention (`layer2_attn`), or of
layer 3's feed-forward from the first decode step on (`layer3_mlp_step_1`). Needs torchtitan, which is no
dependency of compiledump:

    pip install --no-deps torchtitan==0.3.0 spmd_types tyro einops torch_checkpointing typeguard \\
        docstring_parser shtab

Usage: python benchmarks/sweep_torchtitan.py [--seeds 3]   (about a minute on a 2-core CPU box;
results in benchmarks/RESULTS.md)
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
import warnings
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from harness import judge_cases  # noqa: E402
from helpers.hf_dump import scale_output  # noqa: E402  (the tests' planted bug)

PROMPT, STEPS, VOCAB = 12, 3, 2048
CASES = {"honest bf16": None, "MLP": "layer3_mlp", "attention": "layer2_attn", "decode-only MLP": "layer3_mlp_step_1"}


def build(seed: int):
    import torchtitan.models.llama3 as llama3

    torch.manual_seed(seed)
    model = llama3.llama3_configs["debugmodel"]("flex").build()
    model.init_weights(buffer_device=torch.device("cpu"))
    return model.eval()


def session(model, seed: int):
    ids = torch.randint(0, VOCAB, (1, PROMPT + STEPS), generator=torch.Generator().manual_seed(seed))

    def run():
        for end in range(PROMPT, PROMPT + STEPS + 1):
            positions = torch.arange(end)[None]
            model(ids[:, :end], positions=positions, attention_masks=model.get_attention_masks(positions))
    return run


def engine_for(reference, case: str):
    engine = copy.deepcopy(reference)
    if case == "honest bf16":
        return engine.to(torch.bfloat16)
    module = engine.layers["2"].attention if case == "attention" else engine.layers["3"].feed_forward
    scale_output(module, unless=(lambda args: args[0].shape[1] == PROMPT) if case == "decode-only MLP" else None)
    return engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    try:
        build(0)  # (torchtitan's own imports fail where its dependencies are missing)
    except ImportError as error:
        sys.exit(f"sweep_torchtitan: torchtitan is not installed ({error}); see this script's docstring")
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    named = dict.fromkeys(CASES, 0)
    for seed in range(args.seeds):
        with tempfile.TemporaryDirectory(prefix="compiledump_torchtitan_") as root:
            verdicts = judge_cases(build(seed), lambda model: session(model, seed), engine_for, CASES, Path(root))
        for case, (good, status, last) in verdicts.items():
            named[case] += good
            if not good:
                print(f"  seed {seed} {case}: exit {status}: {last}")
    print(f"\n| model | {' | '.join(CASES)} |\n| --- | {' | '.join('---' for _ in CASES)} |")
    print(f"| torchtitan Llama 3 debugmodel | {' | '.join(f'{n}/{args.seeds}' for n in named.values())} |")


if __name__ == "__main__":
    main()
