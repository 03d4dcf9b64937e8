"""A Hugging Face model's compiled decode step, instrumented with `compiledump.instrument()`,
capture on vs no capture calls (issue 14, benchmark 4).

    python benchmarks/bench_hf.py [--model qwen3_moe|mixtral|llama]
    COMPILEDUMP_NATIVE=0 python benchmarks/bench_hf.py     # the pure-Python capture path

The model of examples/hf_reference_vs_compiled.py (built from a small config, random weights,
nothing downloaded): two copies with the same weights, one instrumented with the default taps,
both `torch.compile(model.forward, fullgraph=True)` with a StaticCache and a padded decode batch
of 4. A third copy is instrumented with `step_routing=False` (no `layer<i>_step_router`/
`_step_topk` captures: 8 fewer per step here), a fourth with `step_states=False` (no
`layer<i>_step`, `_attn_step`, `_mlp_step` captures: 12 fewer). After the prefill, the same decode step (same
position, so the cache never fills) is timed interleaved in one process, one thread. Prints the
median ms per step, the ratios to the plain model (target <= 1.15) and the number of capture
calls per step of each.
"""

from __future__ import annotations

import argparse
import sys

import torch

from harness import REPO, interleaved, machine, median, ratio, scratch_dir

sys.path.insert(0, str(REPO / "examples"))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen3_moe", choices=("qwen3_moe", "mixtral", "llama"))
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    import copy

    from hf_reference_vs_compiled import PROMPT_LEN, Inputs, build_model, cache_kwargs
    from transformers import StaticCache

    import compiledump
    from compiledump.ops import register

    # tokens=0: the token gate off, so every decode capture is written (the heavier case; with
    # the gate on, decode captures only count a drop), every MoE layer kept; the logits steps
    # past max_steps are counted drops.
    compiledump.configure(dir=scratch_dir(prefix="bench-hf-"), max_steps=4, tokens=0, moe_layers=1000)
    model = build_model(args.model)
    inputs = Inputs(model.config.vocab_size, steps=1, batch=args.batch)
    sides = {"plain": copy.deepcopy(model), "instrumented": model, "no step routing": copy.deepcopy(model),
             "no step states": copy.deepcopy(model)}
    handles = {"instrumented": compiledump.instrument(sides["instrumented"]),
               "no step routing": compiledump.instrument(sides["no step routing"], step_routing=False),
               "no step states": compiledump.instrument(sides["no step states"], step_states=False)}
    # Two functions, not `torch.compile(m.forward)` twice: dynamo caches by code object and does
    # not guard on module hooks, so the second model would run the first one's graph.
    def plain_forward(**kwargs):
        return sides["plain"](**kwargs)

    def instrumented_forward(**kwargs):
        return sides["instrumented"](**kwargs)

    def no_step_routing_forward(**kwargs):
        return sides["no step routing"](**kwargs)

    def no_step_states_forward(**kwargs):
        return sides["no step states"](**kwargs)

    functions = {"plain": plain_forward, "instrumented": instrumented_forward,
                 "no step routing": no_step_routing_forward, "no step states": no_step_states_forward}
    step = {}
    with torch.no_grad():
        for name, m in sides.items():
            forward = torch.compile(functions[name], fullgraph=True)
            # The cache advances on every step (it keeps its own length): room for all of them.
            # A static cache attends over its whole length, so every step costs the same.
            cache = StaticCache(config=m.config, max_cache_len=PROMPT_LEN + 8 + args.rounds * args.calls * 2)
            forward(input_ids=inputs.prefill(), **cache_kwargs(m, cache), cache_position=torch.arange(PROMPT_LEN))
            position, token = torch.tensor([PROMPT_LEN]), inputs.step(0)

            def decode(f=forward, c=cache_kwargs(m, cache), p=position, t=token):
                f(input_ids=t, **c, cache_position=p)
                p.add_(1)

            step[name] = decode
            decode()  # compile the decode graph
        times = interleaved(step, rounds=args.rounds, calls=args.calls, warmup=1)
    captures = {name: len(handle.taps) for name, handle in handles.items()}  # each tap: once per forward
    for handle in handles.values():
        handle.remove()
    compiledump.configure(dir=None)  # no dump at exit: its drops are expected here
    path = "native" if register.native_owns_capture() else "python"
    print(f"machine: {machine()}")
    print(f"{args.model}, decode batch {args.batch}, capture path: {path}; plain "
          f"{median(times['plain']) * 1e3:.3f} ms per step")
    print(f"{'instrument()':<28}{'captures':>9}{'ms':>8}{'ratio':>8}{'target':>8}")
    for name in handles:
        label = {"instrumented": "default taps", "no step routing": "step_routing=False"}.get(name, "step_states=False")
        print(f"{label:<28}{captures[name]:>9}{median(times[name]) * 1e3:>8.3f}"
              f"{ratio(times, name, 'plain'):>8.3f}{1.15:>8.2f}")


if __name__ == "__main__":
    main()
