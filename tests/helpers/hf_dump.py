"""Hugging Face models dumped with `compiledump.instrument`, as the tests that compare real models
against their float32 reference need them: one prefill (`dump_prefill`), or any run (`dump_run`);
nothing else is configured."""

from __future__ import annotations

import copy
import dataclasses
import json
import warnings
from pathlib import Path

import numpy as np
import torch

import compiledump
from compiledump import config as cd_config


def load_dump(path) -> tuple[dict, dict]:
    """The arrays of the dump at `path` (an .npz) and its manifest."""
    manifest = json.loads(Path(path).with_suffix(".json").read_text())
    with np.load(path) as data:
        return {key: data[key] for key in data.files}, manifest


def forward_hidden(model: torch.nn.Module, ids: torch.Tensor):
    """`model`'s output for `ids` (no KV cache given), with every layer's hidden states."""
    with torch.no_grad():
        return model(input_ids=ids, output_hidden_states=True)


def router_output(model: torch.nn.Module, layer: int, ids: torch.Tensor):
    """What layer `layer`'s router returns for `ids`, read by a hook of its own (its block is `mlp`
    or `feed_forward`, its router `gate` or `router`)."""
    block = getattr(model.model.layers[layer], "mlp", None) or model.model.layers[layer].feed_forward
    router = getattr(block, "router", None) or block.gate
    got = []
    hook = router.register_forward_hook(lambda _m, _a, out: got.append(out))
    with torch.no_grad():
        model(input_ids=ids)
    hook.remove()
    return got[0]


def scale_output(module: torch.nn.Module, factor: float = 1.01, unless=None):
    """Plant a bug: scale `module`'s output (a tuple's first element) by `factor`, except in the calls
    whose positional inputs `unless(args)` accepts (a prompt's call, for a decode-only bug). Returns
    the hook's handle."""
    def hook(_module, args, out):
        if unless is not None and unless(args):
            return None
        return (out[0] * factor, *out[1:]) if isinstance(out, tuple) else out * factor
    return module.register_forward_hook(hook)


def change_call(module: torch.nn.Module, call: int, change) -> None:
    """Plant a bug in one forward: `module`'s `call`-th call (from 1) returns `change(*its outputs)`
    (a router's `(logits, weights, ids)` at one decode step: the prompt's forward is call 1)."""
    forward, calls = module.forward, []

    def changed(*args, **kwargs):
        out = forward(*args, **kwargs)
        calls.append(None)
        return change(*out) if len(calls) == call else out
    module.forward = changed


def dump_run(model: torch.nn.Module, directory: Path, run, **options) -> str:
    """`run()` with `model` instrumented (`options` as `instrument` takes them), every setting at its
    default and the dump in `directory`; the dump's path."""
    compiledump.reset()
    compiledump.configure(**dataclasses.asdict(cd_config.Config(dir=str(directory))))
    handle = compiledump.instrument(model, **options)
    with torch.no_grad():
        run()
    handle.remove()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the token gate's drops are deliberate
        return compiledump.flush()


def prompt_then_steps(model: torch.nn.Module, ids: torch.Tensor, tokens=(5, 17, 42)):
    """A run for `dump_run`: the prompt `ids` through `model` with a KV cache, then one decode step
    per token of `tokens`."""
    def run():
        out = model(input_ids=ids, use_cache=True)
        for token in tokens:
            out = model(input_ids=torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
    return run


def compare_run(reference: str, model: torch.nn.Module, directory: Path, run):
    """`run()` dumped as `dump_run` dumps it and compared with the dump at `reference` (the
    comparison's warnings ignored: the tests read its report); the report and its last line."""
    from compiledump.compare import compare, format_report

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        report = compare(reference, dump_run(model, directory, run))
    return report, format_report(report)[-1]


def dump_prefill(model: torch.nn.Module, directory: Path, ids: torch.Tensor, rows: str = "one",
                 moe_layers: int = 4, router_rows: str | None = "all", wrap=None, **settings) -> None:
    """Run ``model`` on ``ids`` once (no KV cache) with every MoE layer's ids recorded, and flush
    the dump into ``directory``; compiledump is reset before and after. ``router_rows`` as
    ``instrument`` takes it; ``wrap`` (e.g. ``torch.compile``) turns the instrumented model into
    what is called; ``settings``: other compiledump settings than their defaults (``arena_mb``)."""
    compiledump.reset()
    previous = compiledump.get_config()
    # Every other setting at its default: a test earlier in this process may have changed one
    # (COMPILEDUMP_TOKENS=0 would let a later call of another token count overwrite the values).
    config = cd_config.Config(dir=str(directory), moe_layers=moe_layers, rows=rows, **settings)
    compiledump.configure(**dataclasses.asdict(config))
    handle = compiledump.instrument(model, router_rows=router_rows)
    with torch.no_grad():
        (wrap(model) if wrap is not None else model)(input_ids=ids, use_cache=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the token gate's drops are deliberate
        compiledump.flush()
    handle.remove()
    compiledump.reset()
    compiledump.configure(**dataclasses.asdict(previous))


def compare_bf16_prefill(reference: torch.nn.Module, root: Path, ids: torch.Tensor, rows: str, engine_bug=None,
                         reference_dump: Path | None = None):
    """One prefill of the float32 ``reference`` and of its bfloat16 copy (broken by ``engine_bug(engine)``
    when given) dumped under ``root``/ref and ``root``/run, and their comparison's report.
    ``reference_dump``: the reference's dump of the same ids and rows, made by an earlier call
    (``root``/ref of it), instead of running the reference again."""
    from compiledump.compare import compare

    engine = copy.deepcopy(reference).to(torch.bfloat16)
    if engine_bug is not None:
        engine_bug(engine)
    if reference_dump is None:
        reference_dump = root / "ref"
        dump_prefill(reference, reference_dump, ids, rows)
    dump_prefill(engine, root / "run", ids, rows)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return compare(reference_dump, root / "run")
