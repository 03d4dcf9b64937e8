"""A Hugging Face model as a reference and as a compiled engine, dumped with `compiledump.instrument`
and nothing else, then compared.

    python examples/hf_reference_vs_compiled.py [OUT] [--model qwen3_moe|mixtral|llama|deepseek_v3|deepseek_v3_grouped] [--batch 4]
        [--steps 6] [--dtype float32|bfloat16|float16] [--rows one|all]
        [--inject-bug LAYER [--bug norm|experts|expert]] [--exclude TAG_PATTERN]...

The model is built from a small config with random weights (nothing is downloaded), the same
weights on both sides:

- reference: eager, float32, a batch of one request, a DynamicCache;
- engine: `torch.compile(model.forward, fullgraph=True)` with a StaticCache, a padded batch
  (row 0 is the request, the other rows other prompts), in `--dtype`.

Both decode the same teacher-forced tokens, so a bug changes values, not inputs. `--inject-bug`
breaks one layer of the engine side only: `norm` scales its post-attention norm weight by
`--scale` (default 1.01), `experts` every expert's down projection (the MLP's for a dense
model), `expert` one expert's, chosen among those the prompt uses but its last token does not
(so only `--rows all` can see it before the layer output). `--exclude` leaves tags out of the
engine's `instrument` (`--exclude 'layer{i}_mlp'`: the taps whose capture can move a compiled bf16
MoE model's rounding; without them a bug inside the MoE block can go unseen: docs/compiling.md).
Prints the comparison and exits with its status (0 no
divergence, 1 divergence, 3 not comparable).
"""

from __future__ import annotations

import argparse
import copy
import inspect
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
from transformers import (AutoModelForCausalLM, DeepseekV3Config, DynamicCache, LlamaConfig, MixtralConfig,
                          Qwen3MoeConfig, StaticCache)

import compiledump
from compiledump.compare import CompareOptions, compare, format_report

# initializer_range 0.1 instead of 0.02: with the default, every sublayer's output is a few percent
# of the residual stream, far less than in a trained model, and a bug inside one barely moves it.
SIZES = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=64, initializer_range=0.1)
CONFIGS = {
    "qwen3_moe": lambda: Qwen3MoeConfig(**SIZES, moe_intermediate_size=48, num_experts=8, num_experts_per_tok=2),
    "mixtral": lambda: MixtralConfig(**SIZES, num_local_experts=8, num_experts_per_tok=2),
    "llama": lambda: LlamaConfig(**SIZES),
    # One expert group: a plain top-k of sigmoid scores; one shared expert.
    "deepseek_v3": lambda: DeepseekV3Config(**{**SIZES, "head_dim": 8, "num_key_value_heads": 4},
                                            moe_intermediate_size=48, n_routed_experts=8, num_experts_per_tok=2,
                                            n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
                                            kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                            v_head_dim=16),
    # DeepSeek-V3's own routing, scaled down: 16 experts in 4 groups, top-4 inside the best 2, by
    # sigmoid scores plus a bias (build_model draws it); instrument() declares that selection.
    "deepseek_v3_grouped": lambda: DeepseekV3Config(**{**SIZES, "head_dim": 8, "num_key_value_heads": 4},
                                                    moe_intermediate_size=48, n_routed_experts=16,
                                                    num_experts_per_tok=4, n_shared_experts=1, first_k_dense_replace=1,
                                                    n_group=4, topk_group=2, kv_lora_rank=16, q_lora_rank=16,
                                                    qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16),
}
BUGS = ("norm", "experts", "expert")
PROMPT_LEN = 7



def build_model(name: str, seed: int = 0) -> torch.nn.Module:
    """The model `name` from its small config, float32, eval mode, weights from `seed` (and a
    router bias of std 0.02, where the model has one: a config builds it zero, a trained one is not)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(CONFIGS[name]()).eval()
    if name == "deepseek_v3_grouped":
        with torch.no_grad():
            for module in model.modules():
                if isinstance(getattr(module, "e_score_correction_bias", None), torch.Tensor):
                    module.e_score_correction_bias.normal_(0.0, 0.02)
    return model


class Inputs:
    """The request (prompt + teacher-forced decode tokens) and the other rows of a padded batch."""

    def __init__(self, vocab: int, steps: int, batch: int, seed: int = 1):
        g = torch.Generator().manual_seed(seed)
        self.prompt = torch.randint(0, vocab, (1, PROMPT_LEN), generator=g)
        self.decode = torch.randint(0, vocab, (steps,), generator=g)
        self.others = torch.randint(0, vocab, (batch - 1, PROMPT_LEN + steps), generator=g)
        self.steps, self.batch = steps, batch

    def prefill(self) -> torch.Tensor:
        return torch.cat([self.prompt, self.others[:, :PROMPT_LEN]])

    def step(self, n: int) -> torch.Tensor:
        return torch.cat([self.decode[n : n + 1], self.others[:, PROMPT_LEN + n]])[:, None]


def _start(out: Path, rows: str) -> None:
    compiledump.reset()
    compiledump.configure(dir=str(out), rows=rows)


def _flush() -> str:
    with warnings.catch_warnings():  # the comparison lists each side's drops
        warnings.simplefilter("ignore", RuntimeWarning)
        return compiledump.flush()


def _move(npz: str, out: Path) -> str:
    """The dump (npz + manifest) moved into `out`; returns its new npz path."""
    out.mkdir(parents=True, exist_ok=True)
    for path in (Path(npz), Path(npz).with_suffix(".json")):
        path.replace(out / path.name)
    return str(out / Path(npz).name)


def cache_kwargs(model: torch.nn.Module, cache) -> dict:
    """`cache` under the keyword `model.forward` takes, with `use_cache=True`: `cache` from
    transformers 5.25 on (which deprecates `past_key_values`, to go in 5.40), else `past_key_values`."""
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    return {name: cache, "use_cache": True}


def run_reference(model: torch.nn.Module, inputs: Inputs, out: Path, rows: str = "one") -> str:
    """Eager, float32, the request alone, DynamicCache; returns the dump's path."""
    torch._dynamo.reset()
    _start(out, rows)
    handle = compiledump.instrument(model)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=inputs.prompt, **cache_kwargs(model, cache))
        for n in range(inputs.steps):
            model(input_ids=inputs.step(n)[:1], **cache_kwargs(model, cache))
    handle.remove()
    return _flush()


class Engine:
    """The model compiled as an engine runs it: fullgraph, StaticCache, padded batch, `dtype`.

    `run` may be called again after weights changed in place (an injected bug): the compiled
    graphs take the weights as inputs, so nothing recompiles.
    """

    def __init__(self, model: torch.nn.Module, inputs: Inputs, dtype: torch.dtype = torch.float32,
                 rows: str = "one", dump_dir: Path | None = None, exclude: tuple[str, ...] = ()):
        self.model, self.inputs, self.rows = model.to(dtype), inputs, rows
        torch._dynamo.reset()
        # Where each flush writes before `run` moves the dump out: removed with the engine.
        self._scratch = tempfile.TemporaryDirectory(prefix="compiledump-engine-") if dump_dir is None else None
        _start(dump_dir or Path(self._scratch.name), rows)
        self.handle = compiledump.instrument(self.model, exclude=exclude)  # before compiling: dynamo traces the hooks
        self.forward = torch.compile(self.model.forward, fullgraph=True)
        self.graphs = self.breaks = 0

    def run(self, out: Path) -> str:
        """One session (prefill + teacher-forced decode steps) into a fresh dump in `out`."""
        from torch._dynamo.utils import counters

        # A fresh dump in the same arena: the compiled graphs stay valid. (configure(dir=...)
        # would recompile them: compiled code guards on the settings.)
        compiledump.clear()
        cache = StaticCache(config=self.model.config, max_cache_len=PROMPT_LEN + self.inputs.steps + 1)
        graphs_before = counters["stats"]["unique_graphs"]
        with torch.no_grad():
            self.forward(input_ids=self.inputs.prefill(), **cache_kwargs(self.model, cache),
                         cache_position=torch.arange(PROMPT_LEN))
            for n in range(self.inputs.steps):
                self.forward(input_ids=self.inputs.step(n), **cache_kwargs(self.model, cache),
                             cache_position=torch.tensor([PROMPT_LEN + n]))
        self.graphs += counters["stats"]["unique_graphs"] - graphs_before
        self.breaks = sum(counters["graph_break"].values())
        return _move(_flush(), out)


def inject(model: torch.nn.Module, bug: str, layer: int, scale: float, expert: int | None = None):
    """Scale weights of `layer` in place (see the module docstring); returns a function that undoes it."""
    block = model.model.layers[layer]
    if bug == "norm":
        weight = block.post_attention_layernorm.weight
    elif hasattr(block.mlp, "experts"):
        weight = block.mlp.experts.down_proj if bug == "experts" else block.mlp.experts.down_proj[expert]
    else:
        if bug == "expert":
            raise ValueError("--bug expert needs an MoE model")
        weight = block.mlp.down_proj.weight
    saved = weight.detach().clone()
    with torch.no_grad():
        weight.mul_(scale)

    def undo() -> None:
        with torch.no_grad():
            weight.copy_(saved)

    return undo


def pick_expert(model: torch.nn.Module, inputs: Inputs, layer: int) -> int:
    """An expert of `layer` that some prompt token routes to but the last one does not."""
    ids = []
    hook = model.model.layers[layer].mlp.gate.register_forward_hook(lambda _m, _a, out: ids.append(out[2]))
    with torch.no_grad():
        model(input_ids=inputs.prompt)
    hook.remove()
    used, last = set(ids[0][:-1].flatten().tolist()), set(ids[0][-1].tolist())
    return min(used - last)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", nargs="?", help="where the dumps go (default: a new temporary directory)")
    parser.add_argument("--model", choices=sorted(CONFIGS), default="qwen3_moe")
    parser.add_argument("--batch", type=int, default=4, help="engine batch: the request + padding rows")
    parser.add_argument("--steps", type=int, default=6, help="decode steps")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    parser.add_argument("--rows", choices=("one", "all"), default="one", help="COMPILEDUMP_ROWS on both sides")
    parser.add_argument("--inject-bug", type=int, metavar="LAYER", help="break this layer of the engine side")
    parser.add_argument("--bug", choices=BUGS, default="norm")
    parser.add_argument("--scale", type=float, default=1.01, help="the injected bug's scale (default 1.01)")
    parser.add_argument("--exclude", action="append", default=[], metavar="TAG_PATTERN",
                        help="leave this tag out of the engine's instrument(), {i} for every layer (repeatable)")
    args = parser.parse_args(argv)
    out = Path(args.out or tempfile.mkdtemp(prefix="compiledump-hf-"))
    model = build_model(args.model)
    inputs = Inputs(model.config.vocab_size, args.steps, args.batch)
    started = time.perf_counter()
    reference = run_reference(model, inputs, out / "reference", args.rows)
    engine = Engine(copy.deepcopy(model), inputs, getattr(torch, args.dtype), args.rows, exclude=tuple(args.exclude))
    if args.inject_bug is not None:
        expert = pick_expert(model, inputs, args.inject_bug) if args.bug == "expert" else None
        inject(engine.model, args.bug, args.inject_bug, args.scale, expert)
    run = engine.run(out / "engine")
    print(f"[hf] {args.model}: engine {args.dtype}, batch {args.batch}: {engine.graphs} graph(s), "
          f"{engine.breaks} graph break(s) ({time.perf_counter() - started:.1f} s)")
    report = compare(reference, run, CompareOptions())
    for line in format_report(report, table="divergent"):
        print(line)
    return report.exit_status


if __name__ == "__main__":
    sys.exit(main())
