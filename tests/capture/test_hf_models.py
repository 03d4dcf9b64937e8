"""Real models, instrumented with `compiledump.instrument(model)` and nothing else: a Hugging Face
model built from config as an eager float32 reference (batch of one, DynamicCache) against the
same model compiled as an engine (`torch.compile(fullgraph=True)`, StaticCache, batch of one or
a padded batch of four), compared with default settings (examples/hf_reference_vs_compiled.py
is the same flow as a script).

Each engine compiles once; its injected bugs scale weights in place between sessions, so they
reuse the compiled graphs. Every compile costs tens of seconds on a 2-core CPU, so the engines
are module-scoped fixtures, shared by the checks of issue 12 (taps, compile, layouts, all rows)
and issue 13 (verdicts with default thresholds).
"""

import copy
import dataclasses
import logging
import warnings
from unittest import mock

import pytest
import torch
from torch._dynamo.utils import counters
from torch._inductor.graph import GraphLowering

import compiledump
from compiledump import cli
from compiledump import config as cd_config
from compiledump.compare import CompareOptions, compare
from helpers import readme_samples
from helpers.hf_example import ex


STEPS = 3
LAYERS = 3  # bugs go into layer 1: its internals pass the default MoE filter (layers 0 and 1), layer 2 follows


class RecompileLog(logging.Handler):
    """The lines TORCH_LOGS=recompiles prints, collected."""

    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())

    def __enter__(self):
        torch._logging.set_logs(recompiles=True)
        self.logger = logging.getLogger("torch._dynamo.guards.__recompiles")
        self.logger.addHandler(self)
        return self

    def __exit__(self, *_):
        self.logger.removeHandler(self)
        torch._logging.set_logs()


def _model(name):
    ex.SIZES["num_hidden_layers"] = LAYERS
    try:
        return ex.build_model(name)
    finally:
        ex.SIZES["num_hidden_layers"] = 4


class Pair:
    """A model, its reference dump, and the sessions of one compiled engine: clean, then with each
    bug of `bugs` ((name, layer, scale) scaled in place between sessions). Everything runs here,
    at fixture setup: another fixture's engine resets the capture state its graphs were traced
    against, so no engine is used after the next one exists."""

    def __init__(self, name, batch, tmp, dtype=torch.float32, rows="one", bugs=()):
        self.name = name
        self.model = _model(name)
        self.inputs = ex.Inputs(self.model.config.vocab_size, STEPS, batch)
        self.expert = ex.pick_expert(self.model, self.inputs, 1) if hasattr(self.model.model.layers[1].mlp, "gate") \
            else None
        self.reference = ex.run_reference(self.model, self.inputs, tmp / "reference", rows)
        counters.clear()
        with RecompileLog() as log:
            engine = ex.Engine(copy.deepcopy(self.model), self.inputs, dtype, rows)
            compiled, self.clean_logits = engine.forward, []

            def forward(**kwargs):  # the clean session's logits, kept (test_recompiles_... reads Llama's)
                out = compiled(**kwargs)
                self.clean_logits.append(out.logits.clone())
                return out
            engine.forward = forward
            self.clean = engine.run(tmp / "engine")
            engine.forward = compiled
        self.recompile_lines = [line for line in log.lines if "Recompiling" in line]
        self.graphs, self.breaks = engine.graphs, sum(counters["graph_break"].values())
        self.bugs = {}
        for bug, layer, scale in bugs:
            undo = ex.inject(engine.model, bug, layer, scale, self.expert)
            try:
                self.bugs[bug, layer, scale] = engine.run(tmp / f"{bug}{layer}_{scale}")
            finally:
                undo()
        # no recompile after the first decode step, bugs included
        self.graphs_after_bugs = engine.graphs

    def verdict(self, run):
        return compare(self.reference, run, CompareOptions())


def _pair(name, batch, tmp_path_factory, **kwargs):
    torch._dynamo.reset()
    compiledump.reset()  # keeps the settings: the defaults are set again below
    previous = compiledump.get_config()
    # The default settings, as a user's run has them, whatever an earlier test file of this
    # worker left configured (the README's Comparing sample is compared with this output).
    compiledump.configure(**dataclasses.asdict(cd_config.Config(dir=previous.dir)))
    try:
        return Pair(name, batch, tmp_path_factory.mktemp(f"{name}_b{batch}"), **kwargs)
    finally:
        compiledump.reset()
        compiledump.configure(**dataclasses.asdict(previous))


ONE_PERCENT = [("norm", 1, 1.01), ("experts", 1, 1.01)]


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral", "llama"])
def batch4(request, tmp_path_factory):
    bugs = ONE_PERCENT + ([("expert", 1, 1.01)] if request.param != "llama" else [])
    return _pair(request.param, 4, tmp_path_factory, bugs=bugs)


def _first(report):
    first = report.first_divergence
    return (first.key, first.layer) if first is not None else None


def test_padded_batch_engine_matches_the_reference(batch4):
    report = batch4.verdict(batch4.clean)
    assert report.exit_status == 0, _first(report)
    # prefill + decode: two graphs, no break, and none added by the bug sessions
    assert (batch4.graphs, batch4.breaks, batch4.graphs_after_bugs) == (2, 0, 2)
    keys = {record.key for record in report.keys}
    assert {"layer0", "layer1_attn", "layer1_mlp", "final_norm", "logits_3"} <= keys


@pytest.mark.parametrize("bug", ONE_PERCENT, ids=[bug[0] for bug in ONE_PERCENT])
def test_a_one_percent_bug_is_named_at_its_layer(batch4, bug, capsys):
    report = batch4.verdict(batch4.bugs[bug])
    assert report.exit_status == 1
    assert report.first_divergence.layer == 1, _first(report)
    if (batch4.name, bug[0]) == ("qwen3_moe", "norm"):
        # The README's "Comparing" sample is this comparison (there with 4 layers and 6 steps).
        capsys.readouterr()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            assert cli.main(["compare", batch4.reference, batch4.bugs[bug], "--table", "none"]) == 1
        sample = readme_samples.console_output(readme_samples.block_after("## Comparing"), "compiledump compare")
        assert readme_samples.unmatched(sample, capsys.readouterr().out.splitlines()) == []


@pytest.mark.parametrize("batch4", ["llama"], indirect=True)  # batch4's own Llama engine, not another
def test_recompiles_are_the_uninstrumented_models(batch4):
    """The recompile log of the instrumented engine equals an uninstrumented one's, with capture
    off the instrumented engine compiles to the uninstrumented model's code, and with capture on
    its logits are the uninstrumented engine's bit for bit (float32 Llama: capture moves no
    rounding here; bf16 MoE blocks are where it can, benchmarks/numerics_preserved.py). The
    instrumented engine with capture on is batch4's Llama engine (its clean session: the same
    model, inputs, cache and compile as a session here), not compiled a second time."""
    model = _model("llama")
    inputs = ex.Inputs(model.config.vocab_size, STEPS, 4)

    def session(instrumented):  # capture off
        torch._dynamo.reset()
        compiledump.reset()
        previous = compiledump.get_config()
        compiledump.configure(dir=None)
        engine_model = copy.deepcopy(model)
        handle = compiledump.instrument(engine_model) if instrumented else None
        forward = torch.compile(engine_model.forward, fullgraph=True)
        cache = ex.StaticCache(config=model.config, max_cache_len=ex.PROMPT_LEN + STEPS + 1)
        codes, logits = [], []
        # Inductor's generated code of each graph, without run_and_get_code (it resets dynamo on
        # every call, so there would be no recompile to log).
        with RecompileLog() as log, torch.no_grad(), mock.patch.object(GraphLowering, "save_output_code",
                                                                        staticmethod(codes.append)):
            logits.append(forward(input_ids=inputs.prefill(), **ex.cache_kwargs(engine_model, cache),
                                  cache_position=torch.arange(ex.PROMPT_LEN)).logits.clone())
            for n in range(STEPS):
                logits.append(forward(input_ids=inputs.step(n), **ex.cache_kwargs(engine_model, cache),
                                      cache_position=torch.tensor([ex.PROMPT_LEN + n])).logits.clone())
        if handle is not None:
            handle.remove()
        compiledump.configure(dir=previous.dir)
        return [line for line in log.lines if "Recompiling" in line], codes, logits

    plain_log, plain_code, plain_logits = session(False)
    off_log, off_code, _ = session(True)
    on_log, on_logits = batch4.recompile_lines, batch4.clean_logits
    assert len(plain_code) == 2 and off_code == plain_code  # byte for byte: nothing added while capture is off
    assert len(on_logits) == STEPS + 1 and all(torch.equal(a, b) for a, b in zip(plain_logits, on_logits))
    assert len(plain_log) == 1, (plain_log, off_log, on_log)
    assert on_log == plain_log == off_log  # the prefill -> decode recompile only


@pytest.fixture(scope="module")
def all_rows(tmp_path_factory):
    return _pair("qwen3_moe", 4, tmp_path_factory, rows="all", bugs=[("expert", 1, 1.01)])


@pytest.mark.parametrize("batch4", ["qwen3_moe"], indirect=True)  # one comparison of the two modes
def test_one_expert_bug_needs_all_rows(all_rows, batch4):
    """One expert's down projection x 1.01, an expert the prompt uses but its last token does not."""
    assert all_rows.verdict(all_rows.clean).exit_status == 0
    report = all_rows.verdict(all_rows.bugs["expert", 1, 1.01])
    assert report.exit_status == 1 and report.first_divergence.layer == 1, _first(report)
    assert report.first_divergence.divergent_rows, "the token positions that diverge are named"
    # One row per record: the last token never sees that expert, so layer 1 looks clean.
    one_row = batch4.verdict(batch4.bugs["expert", 1, 1.01])
    assert one_row.first_divergence is None or one_row.first_divergence.layer != 1


@pytest.fixture(scope="module")
def batch1_bf16(tmp_path_factory):
    # The batch of one is the bfloat16 engine: a batch of one differs from the padded batch of
    # four (every model's, float32) only in its shapes, and bf16 from float32 only in its dtype, so
    # one engine checks both (each engine more is another minute of compiling on 2 cores). Compiled
    # bf16 engines with a padded batch of 4 are tests/helpers/engine_flow.py's (test_hf_indexers'
    # DeepSeek-V3.2, test_sparsemixer's PhiMoE).
    return _pair("qwen3_moe", 1, tmp_path_factory, dtype=torch.bfloat16, bugs=[("experts", 1, 1.05)])


def test_batch_of_one_bf16_engine_against_fp32_reference(batch1_bf16):
    """A batch of one, unpadded, in a bfloat16 engine against the float32 reference: clean, in two
    graphs without a break; a x 1.05 scale of every expert of layer 1 is named at layer 1, and its
    session adds no graph."""
    clean = batch1_bf16.verdict(batch1_bf16.clean)
    assert clean.exit_status == 0, "\n".join(compiledump.compare.format_report(clean, table="divergent"))
    assert (batch1_bf16.graphs, batch1_bf16.breaks, batch1_bf16.graphs_after_bugs) == (2, 0, 2)
    report = batch1_bf16.verdict(batch1_bf16.bugs["experts", 1, 1.05])
    assert report.exit_status == 1 and report.first_divergence.layer == 1, _first(report)
