"""A small tensor-parallel model for the multi-rank tests, and the per-rank worker script.

The math (per layer, hidden D, ffn F, vocab V):

    h = x @ W1            column-parallel: rank r holds W1[:, r*F/tp : (r+1)*F/tp]
    p = gelu(h) @ W2      row-parallel:    rank r holds W2[r*F/tp : (r+1)*F/tp, :] -> a partial sum
    x = x + all_reduce(p)
    logits = all_gather(x @ Wv[:, vocab shard])   (vocab-parallel head)

With `group=None` the same function runs unsharded in one process: that is the reference.
Collectives go through torch.distributed's functional collectives (gloo on CPU), so the whole
forward, collectives included, compiles with `torch.compile(fullgraph=True)`.

Run as a script, one process per rank (see `tests/capture/test_parallel.py`):

    python tests/tp_model.py RANK WORLD INIT_URL OUT_DIR BUG_RANK
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.nn.functional as F

import compiledump

D, FFN, VOCAB, LAYERS, PROMPT, STEPS = 16, 32, 24, 2, 5, 3
SEED = 1234


def weights() -> dict[str, torch.Tensor]:
    """The full (unsharded) weights, the same in every process."""
    gen = torch.Generator().manual_seed(SEED)
    w = {"emb": torch.randn(VOCAB, D, generator=gen), "head": torch.randn(D, VOCAB, generator=gen) / D**0.5,
         "pos": torch.randn(PROMPT + STEPS, D, generator=gen)}
    for layer in range(LAYERS):
        w[f"w1_{layer}"] = torch.randn(D, FFN, generator=gen) / D**0.5
        w[f"w2_{layer}"] = torch.randn(FFN, D, generator=gen) / FFN**0.5
    return w


def shard(w: dict[str, torch.Tensor], rank: int, world: int, bug: bool = False) -> dict[str, torch.Tensor]:
    """Rank `rank`'s slices; `bug` scales this rank's layer-1 W1 slice by 1.5 (a wrong shard)."""
    f, v = FFN // world, VOCAB // world
    out = {"emb": w["emb"], "pos": w["pos"], "head": w["head"][:, rank * v:(rank + 1) * v].contiguous()}
    for layer in range(LAYERS):
        out[f"w1_{layer}"] = w[f"w1_{layer}"][:, rank * f:(rank + 1) * f].contiguous()
        out[f"w2_{layer}"] = w[f"w2_{layer}"][rank * f:(rank + 1) * f].contiguous()
    if bug:
        out["w1_1"] = out["w1_1"] * 1.5
    return out


def declare() -> None:
    """What each tag is across the tensor-parallel ranks."""
    compiledump.declare_shard(r"layer\d+_up", dim=0, how="concat", group="tp")
    compiledump.declare_shard(r"layer\d+_partial", how="sum", group="tp")
    compiledump.declare_shard("logits_shard", dim=0, how="concat", group="tp")


def make_forward(group):
    """forward(x, w, decode) for one rank of `group`, or unsharded when `group` is None."""
    if group is not None:
        import torch.distributed._functional_collectives as funcol

    def forward(x: torch.Tensor, w: dict[str, torch.Tensor], decode: bool) -> torch.Tensor:
        if not decode:
            compiledump.record("embed", x)
        for layer in range(LAYERS):
            h = x @ w[f"w1_{layer}"]
            p = F.gelu(h) @ w[f"w2_{layer}"]
            if not decode:
                compiledump.record(f"layer{layer}_up", h)
                compiledump.record(f"layer{layer}_partial", p)
            if group is not None:
                p = funcol.all_reduce(p, "sum", group)
            x = x + p
            if decode:
                compiledump.record_step(f"hidden{layer}", x)
            else:
                compiledump.record(f"layer{layer}", x)
        local = x @ w["head"]
        logits = local
        if group is not None:
            # all_gather_tensor concatenates along dim 0: gather the transposed shards.
            logits = funcol.all_gather_tensor(local.t().contiguous(), 0, group).t()
        if decode:
            compiledump.record_step("logits_shard", local)
            compiledump.record_step("logits", logits)
        else:
            compiledump.record("logits", logits, once=True)
            compiledump.record_ids("top_ids", torch.topk(logits, 2, dim=-1).indices)
        return logits

    return forward


def generate(forward, w: dict[str, torch.Tensor]) -> list[int]:
    """Greedy prefill + STEPS decode steps from a fixed prompt; returns the generated tokens."""
    tokens = list(range(3, 3 + PROMPT))
    logits = forward(w["emb"][torch.tensor(tokens)] + w["pos"][:PROMPT], w, False)
    out = []
    for step in range(STEPS):
        token = int(logits[-1].argmax())
        out.append(token)
        logits = forward(w["emb"][torch.tensor([token])] + w["pos"][PROMPT + step], w, True)
    return out


def stagger_compiles(rank: int, marks: str, timeout: float = 120.0) -> None:
    """Rank 0 compiles each graph first; the other ranks start their Nth compile only once rank
    0 has finished its Nth, so they load it from the Inductor caches (TORCHINDUCTOR_CACHE_DIR,
    shared) instead of compiling the same graph at the same time. Only the cost changes: a rank
    whose mark does not come within `timeout` compiles on its own. Rank 0 compiles before it
    runs its graph's collectives, so no rank waits for one that waits for it."""
    from torch._dynamo.callback import callback_handler

    os.makedirs(marks, exist_ok=True)
    count = [0]
    if rank == 0:
        def done(_args):
            count[0] += 1
            open(os.path.join(marks, str(count[0])), "w").close()

        callback_handler.register_end_callback(done)
    else:
        def wait(_args):
            count[0] += 1
            deadline = time.monotonic() + timeout
            while not os.path.exists(os.path.join(marks, str(count[0]))) and time.monotonic() < deadline:
                time.sleep(0.02)

        callback_handler.register_start_callback(wait)


def run_rank(rank: int, world: int, init: str, out: str, bug_rank: int) -> None:
    """One tensor-parallel rank: a clean run into OUT/run, then one with a wrong W1 slice on
    `bug_rank` into OUT/run_bug. RANK is not set: the file name comes from torch.distributed."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    group = dist.group.WORLD
    full = weights()
    for name, bug in (("run", False), ("run_bug", rank == bug_rank)):
        compiledump.reset()
        torch._dynamo.reset()
        compiledump.configure(dir=f"{out}/{name}")
        compiledump.set_parallel(tp_rank=rank, tp_size=world)
        declare()
        if name == "run":  # run_bug, after the reset, finds every graph in the caches already
            stagger_compiles(rank, f"{out}/compiled")
        forward = torch.compile(make_forward(group), fullgraph=True)
        tokens = generate(forward, shard(full, rank, world, bug))
        print(f"rank {rank} {name}: tokens {tokens} -> {compiledump.flush()}", flush=True)
        counters = torch._dynamo.utils.counters
        print(f"rank {rank} {name}: graph breaks {sum(counters['graph_break'].values())}", flush=True)
    dist.destroy_process_group()
    # The atexit flush runs after destroy_process_group: it must keep this rank's file name.


if __name__ == "__main__":
    run_rank(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5]))
