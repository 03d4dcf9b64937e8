"""Does capture change a compiled model's outputs? A Hugging Face model compiled without capture
against the same model compiled with `compiledump.instrument()` and capture on, bit for bit.

    python benchmarks/numerics_preserved.py [--models llama,qwen3_moe,mixtral] [--dtypes bfloat16,float32]
        [--taps defaults,layer,attn,mlp,router,no-mlp] [--device cpu|cuda]

The models of examples/hf_reference_vs_compiled.py (small configs, random weights, nothing
downloaded), a batch of 3 prompts of 7 tokens and 2 greedy forwards (no cache), both sides
`torch.compile(model.forward, fullgraph=True)` from a fresh dynamo state. Per tap set it prints
whether the logits are bit-equal to the uninstrumented compiled model's and, where they are not,
the largest difference. Tap sets: `defaults` (what `instrument(model)` attaches), `layer` (each
decoder layer's output only), `attn` (the residual stream after attention), `mlp` (each MLP/MoE
block's output), `router` (the router's logits and picks), `no-mlp` (the defaults but
`exclude=("layer{i}_mlp",)`).

Why outputs can move: a capture op reads a tensor, so Inductor must store it. A value it had kept
in registers inside a fused kernel (in float32, for a bf16 model) becomes a stored buffer, and a
later loop of the same kernel may load that bf16-rounded buffer instead of recomputing the
value: the model computes the same math with different roundings (docs/compiling.md).
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
import warnings

import torch

from harness import REPO, machine

sys.path.insert(0, str(REPO / "examples"))

# Each tap set as instrument()'s arguments.
TAP_SETS = {
    "defaults": {},
    "layer": {"taps": {"layer{i}": "model.layers.{i}"}, "defaults": False},
    "attn": {"taps": {"layer{i}_attn": "model.layers.{i}.post_attention_layernorm:input"}, "defaults": False},
    "mlp": {"taps": {"layer{i}_mlp": "model.layers.{i}.mlp"}, "defaults": False},
    "router": {"taps": {"layer{i}_router": "model.layers.{i}.mlp.gate"}, "defaults": False},
    "no-mlp": {"exclude": ("layer{i}_mlp",)},
}


def forwards(model: torch.nn.Module, ids: torch.Tensor, steps: int = 2) -> list[torch.Tensor]:
    """`steps` greedy forwards of the compiled model (no cache: every forward a new graph shape
    that dynamo marks dynamic after the first)."""
    torch._dynamo.reset()
    forward = torch.compile(model.forward, fullgraph=True)
    outputs = []
    with torch.no_grad():
        for _ in range(steps):
            logits = forward(input_ids=ids, use_cache=False).logits
            outputs.append(logits.clone())
            ids = torch.cat([ids, logits[:, -1:].argmax(-1)], 1)
    return outputs


def instrumented(model: torch.nn.Module, ids: torch.Tensor, tap_set: dict) -> list[torch.Tensor]:
    import compiledump

    with tempfile.TemporaryDirectory(prefix="compiledump-numerics-") as scratch:  # the dump is not read
        compiledump.reset()
        compiledump.configure(dir=scratch)
        handle = compiledump.instrument(model, **tap_set)
        outputs = forwards(model, ids)  # capture on: every tap's kernel runs
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            compiledump.flush()
        handle.remove()
        compiledump.reset()
    return outputs


def difference(plain: list[torch.Tensor], captured: list[torch.Tensor]) -> str:
    if all(torch.equal(a, b) for a, b in zip(plain, captured)):
        return "bit-equal"
    worst = max(float((a.float() - b.float()).abs().max()) for a, b in zip(plain, captured))
    flips = sum(int((a[:, -1].argmax(-1) != b[:, -1].argmax(-1)).sum()) for a, b in zip(plain, captured))
    return f"differs: largest logit difference {worst:.3g}, last-position argmax flips {flips}"


def main(argv=None) -> int:
    from hf_reference_vs_compiled import build_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="llama,qwen3_moe,mixtral")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--taps", default="defaults,layer,attn,mlp,router,no-mlp")
    parser.add_argument("--device", default="cpu", help="where the models run (cuda: Inductor's Triton kernels)")
    args = parser.parse_args(argv)
    print(f"# {machine()}; device {args.device}")
    print("| model | dtype | taps | logits vs the uninstrumented compiled model |")
    print("|---|---|---|---|")
    ids = torch.randint(0, 512, (3, 7), generator=torch.Generator().manual_seed(1)).to(args.device)
    for name in args.models.split(","):
        for dtype_name in args.dtypes.split(","):
            base = build_model(name).to(args.device, getattr(torch, dtype_name))
            plain = forwards(copy.deepcopy(base), ids)
            for tap_set in args.taps.split(","):
                if tap_set == "router" and not hasattr(base.model.layers[0].mlp, "gate"):
                    continue  # a dense model has no router
                captured = instrumented(copy.deepcopy(base), ids, TAP_SETS[tap_set])
                print(f"| {name} | {dtype_name} | {tap_set} | {difference(plain, captured)} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
