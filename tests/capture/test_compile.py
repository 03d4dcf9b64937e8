"""Graph-level properties under torch.compile: nothing added when capture is off, one op per
capture site when on, suspension and no recompiles across decode steps."""

import os
import re
import textwrap

import numpy as np
import pytest
import torch
from torch._inductor.utils import run_and_get_code

import compiledump
from compiledump.capture.state import STATE
from compiledump.demo.model import ModelConfig, TinyMoE
from helpers import forked

# Three layers: the fewest with a layer the default MoE filter drops (layer 2; see the op count
# below). Each layer adds ~2 C++ kernels and ~6 CPU s to every cold compile of this file (5).
CFG = ModelConfig(layers=3, captures_per_layer=4)


def _compiled_code(model, *args):
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    with torch.no_grad():
        _, codes = run_and_get_code(compiled, *args)
    return "\n".join(codes)


def test_disabled_adds_nothing_to_the_graph(tmp_path):
    torch._dynamo.reset()
    compiledump.reset()
    previous = compiledump.get_config()
    compiledump.configure(dir=None)
    try:
        tokens = torch.randint(0, CFG.vocab, (7,))
        code = _compiled_code(TinyMoE(CFG, dump=compiledump), tokens)
        plain = _compiled_code(TinyMoE(CFG), tokens)
    finally:
        compiledump.configure(dir=previous.dir)
    assert "compiledump" not in code
    # Not just "no op": Inductor generates byte for byte the code of the uninstrumented model.
    assert code == plain


def test_one_op_per_capture_site_and_arena_never_cloned(dump_dir):
    tokens = torch.randint(0, CFG.vocab, (7,))
    code = _compiled_code(TinyMoE(CFG, dump=compiledump), tokens)
    calls = code.count("torch.ops.compiledump.capture_v1.default(")
    # Every layer's hidden state; mixer, MoE output and ids only for layers 0 and 1 (the
    # default MoE filter drops `layer<N>_<x>` for N >= 2 on the host); the prefill logits.
    expected = CFG.layers + 2 * 3 + 1
    assert calls == expected
    # The arena and the control block are graph inputs used in place: the only lines that name
    # them are the size assertion, the capture calls and the final `del` (no clone, no copy-back).
    rt = STATE.runtime
    for numel in (rt.arena.numel(), rt.ctrl.numel()):
        (name,) = re.findall(rf"assert_size_stride\((\w+), \({numel}, \)", code)
        body = code.split("def get_args():")[0]  # the module's benchmark harness lists all args
        uses = [line.strip() for line in body.splitlines() if re.search(rf"\b{name}\b", line)]
        for line in uses:
            assert line.startswith(("assert_size_stride", "torch.ops.compiledump.capture_v1", "del ")) or (
                line.endswith("= args")
            ), line
        assert sum(line.startswith("torch.ops.compiledump") for line in uses) == expected


def test_profiling_suspends_record_inside_compiled_code(dump_dir):
    """The required improvement over the seed: record() is suspended too, with no recompile."""
    model = torch.compile(TinyMoE(CFG, dump=compiledump), fullgraph=True)
    tokens = torch.randint(0, CFG.vocab, (7,))
    with torch.no_grad():
        with compiledump.profiling():
            model(tokens)  # compiled and run while suspended: writes nothing
        assert compiledump.flush() is not None
        data = np.load(compiledump.flush())
        assert data.files == []
        model(tokens)
        data = np.load(compiledump.flush())
        assert "layer0" in data.files and "logits" in data.files


EXPLAIN_SCRIPT = textwrap.dedent(
    """
    import os, torch, compiledump
    from compiledump.demo.model import ModelConfig, TinyMoE
    cfg = ModelConfig(layers=3, captures_per_layer=4)
    model = TinyMoE(cfg, dump=compiledump)
    tokens = torch.randint(0, cfg.vocab, (5,))
    state = torch.randn(cfg.layers, 3, cfg.dim)
    with torch.no_grad():
        prefill = torch._dynamo.explain(model)(tokens)
        decode = torch._dynamo.explain(model)(tokens[:3], state)
    print("BREAKS", prefill.graph_break_count, decode.graph_break_count,
          "GRAPHS", prefill.graph_count, decode.graph_count)
    """
)


def test_no_graph_break_fresh_process(tmp_path):
    # explain() under-reports breaks in a process that already compiled other functions: a child
    # forked from one that imported torch and compiled nothing (helpers/forked.py).
    env = dict(os.environ, COMPILEDUMP_DIR=str(tmp_path / "d"))
    out = forked.run(["-c", EXPLAIN_SCRIPT], env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "BREAKS 0 0 GRAPHS 1 1" in out.stdout


@pytest.mark.parametrize("dynamic", [None, True])
def test_no_recompile_across_decode_steps(dump_dir, dynamic):
    from torch._dynamo.utils import counters

    model = torch.compile(TinyMoE(CFG, dump=compiledump), fullgraph=True, dynamic=dynamic)
    counters.clear()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        _, state = model(torch.randint(0, CFG.vocab, (7,), generator=g))
        state = torch.cat([state, torch.randn(CFG.layers, 3, CFG.dim, generator=g)], 1)
        for step in range(40):
            _, state = model(torch.randint(0, CFG.vocab, (4,), generator=g), state)
            if step == 0:
                graphs = counters["stats"]["unique_graphs"]
    assert counters["stats"]["unique_graphs"] == graphs
    data = np.load(compiledump.flush())
    assert [f"logits_{n}" in data.files for n in (0, 39)] == [True, True]
