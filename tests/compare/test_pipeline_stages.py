"""A pipeline-parallel engine: each rank runs a share of the decoder layers and holds vLLM's
`PPMissingLayer` (an `nn.Identity`) in place of the others, of the token embedding (later stages)
and of the final norm and head (earlier stages). Before 2026-12-06 `instrument()` raised "no
decoder layers found" on every stage, and the comparator refused a run split across ranks against a
single-file reference ("no rank in common"). Now each stage taps its own layers under their index in
the whole model, and the stages' files merge into one side (their `mixers` name disjoint layers).

The stages run one after the other in this process (the first's hidden states and residual fed to
the second, as vLLM's IntermediateTensors carry them), each flushed as its own rank; the reference
is the whole engine (examples/vllm_style_engine.py), teacher-forced with the same tokens.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import warnings
from pathlib import Path

import pytest
import torch

import compiledump
from compiledump import config as cd_config
from compiledump.compare import compare, format_report
from compiledump.compare.shards import pipeline_stages
from compiledump.format.reader import DumpFile
from helpers.hf_example import ex

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
spec = importlib.util.spec_from_file_location("vllm_style_engine", EXAMPLES / "vllm_style_engine.py")
engines = importlib.util.module_from_spec(spec)
spec.loader.exec_module(engines)


class PPMissingLayer(torch.nn.Identity):
    """vLLM's placeholder for a module another pipeline stage holds."""

    def forward(self, *args, **kwargs):
        return args[0] if args else next(iter(kwargs.values()))


def tokens(model):
    generator = torch.Generator().manual_seed(0)
    return (torch.randint(3, model.config.vocab_size, (7,), generator=generator),
            torch.randint(3, model.config.vocab_size, (4,), generator=generator).tolist())


def stage_engine(hf, rank: int, bug_layer: int | None = None):
    """The engine as pipeline stage `rank` of 2 builds it, and the layers it runs."""
    engine = engines.ForCausalLM(hf)
    if bug_layer is not None:
        engine.model.layers[bug_layer].mlp.register_forward_hook(lambda _m, _a, out: out * 1.05)
    n = len(engine.model.layers)
    share = range(0, n // 2) if rank == 0 else range(n // 2, n)
    for i in range(n):
        if i not in share:
            engine.model.layers[i] = PPMissingLayer()
    if rank == 1:
        engine.model.embed_tokens = PPMissingLayer()
    else:
        engine.model.norm, engine.lm_head = PPMissingLayer(), PPMissingLayer()
    return engine, share


def run_stage(hf, rank: int, directory: Path, carried: list | None, monkeypatch, bug_layer=None, file_rank=None,
              world: int = 2, dp_rank: int | None = None, nan_at: int | None = None):
    """Run stage `rank` over the prompt and the decode steps (fed the previous stage's outputs),
    flushed as that rank; returns what it hands the next stage per forward, and the handle's taps."""
    engine, share = stage_engine(hf, rank, bug_layer)
    prompt, steps = tokens(hf)
    layers = [engine.model.layers[i] for i in share]
    handed = []

    def forward(n, input_ids, positions):
        hidden, residual = (engine.model.embed_tokens(input_ids), None) if rank == 0 else carried[n]
        if n == nan_at:  # a NaN this stage meets at its forward n
            hidden = hidden.clone().fill_(float("nan"))
        for layer in layers:
            hidden, residual = layer(positions, hidden, residual)
        if rank == 1:
            engine.compute_logits(engine.model.norm(hidden, residual)[0][-1:])
        handed.append((hidden.clone(), residual.clone()))

    monkeypatch.setenv("RANK", str(rank if file_rank is None else file_rank))
    monkeypatch.setenv("WORLD_SIZE", str(world))
    compiledump.reset()
    compiledump.configure(**dataclasses.asdict(cd_config.Config(dir=str(directory))))
    if dp_rank is not None:
        compiledump.set_parallel(dp_rank=dp_rank, dp_size=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        handle = compiledump.instrument(engine)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for layer in layers:
            layer.self_attn.cache = None
        forward(0, prompt, torch.arange(prompt.numel()))
        for n, token in enumerate(steps):
            forward(n + 1, torch.tensor([token]), torch.tensor([prompt.numel() + n]))
        compiledump.flush()
    handle.remove()
    compiledump.reset()
    return handed, dict(handle.taps), [str(w.message) for w in caught if "compiledump" in str(w.message)]


def whole_engine_reference(hf, directory: Path) -> None:
    engine = engines.ForCausalLM(hf)
    prompt, steps = tokens(hf)
    engines.dump(engine, directory, lambda: engine.generate(prompt, steps))


@pytest.mark.parametrize("name", ["llama", "qwen3_moe"])
def test_each_stage_taps_its_layers_and_the_stages_compare_as_one_run(tmp_path, monkeypatch, name):
    hf = ex.build_model(name)
    whole_engine_reference(hf, tmp_path / "ref")
    handed, first, said_first = run_stage(hf, 0, tmp_path / "run", None, monkeypatch)
    _, second, said_second = run_stage(hf, 1, tmp_path / "run", handed, monkeypatch)
    n = hf.config.num_hidden_layers
    assert {tag for tag in first if tag.startswith("layer") and tag[5:].isdigit()} == {f"layer{i}" for i in range(n // 2)}
    assert {tag for tag in second if tag.startswith("layer") and tag[5:].isdigit()} == {f"layer{i}"
                                                                                       for i in range(n // 2, n)}
    assert "input_token" in first and "logits" not in first and "final_norm" not in first
    assert "logits" in second and "final_norm" in second and "input_token" not in second
    assert not said_first and not said_second, said_first + said_second  # no "no head", "no embedding" warnings
    report = compare(tmp_path / "ref", tmp_path / "run")
    (pair,) = report.pairs
    assert report.exit_status == 0 and not pair.problems, format_report(report)[-1]
    compared = {record.key for record in pair.keys if record.status == "ok"}
    assert {f"layer{n - 1}", "logits_4", f"layer{n - 1}_step_4", "layer0_step_4"} <= compared


def test_a_bug_in_the_second_stage_is_named_at_its_layer(tmp_path, monkeypatch):
    hf = ex.build_model("llama")
    whole_engine_reference(hf, tmp_path / "ref")
    last = hf.config.num_hidden_layers - 1
    handed, _, _ = run_stage(hf, 0, tmp_path / "run", None, monkeypatch, bug_layer=last)
    run_stage(hf, 1, tmp_path / "run", handed, monkeypatch, bug_layer=last)
    report = compare(tmp_path / "ref", tmp_path / "run")
    assert report.exit_status == 1 and report.first_divergence.key == f"layer{last}_mlp", format_report(report)[-1]


def test_ranks_that_tap_the_same_layers_are_not_stages(tmp_path, monkeypatch):
    """Data- or tensor-parallel ranks each tap every layer: their files are not merged as stages
    (they pair by rank, as before)."""
    hf = ex.build_model("llama")
    engine = engines.ForCausalLM(hf)
    prompt, steps = tokens(hf)
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        engines.dump(engine, tmp_path / "run", lambda: engine.generate(prompt, steps))
    files = sorted((tmp_path / "run").glob("*.npz"))
    assert len(files) == 2 and not pipeline_stages([(str(i), DumpFile(path, "RUN")) for i, path in enumerate(files)])


def test_stages_of_tensor_parallel_ranks_merge_and_keep_their_facts(tmp_path, monkeypatch):
    """Pipeline x tensor parallel (vLLM's rank = pp_rank * tp_size + tp_rank; no shards declared: the
    layers' outputs all-reduced): ranks 0 and 1 tap layers 0-1, ranks 2 and 3 layers 2-3. They merge
    into one side (before the review's mend: only rank 0 compared, a second-stage bug missed), and the
    merged manifest keeps a later stage's first NaN/Inf (before: the first stage's manifest alone)."""
    hf = ex.build_model("llama")
    whole_engine_reference(hf, tmp_path / "ref")
    last = hf.config.num_hidden_layers - 1
    for tp in (0, 1):
        handed, _, _ = run_stage(hf, 0, tmp_path / "run", None, monkeypatch, bug_layer=last, file_rank=tp, world=4)
        run_stage(hf, 1, tmp_path / "run", handed, monkeypatch, bug_layer=last, file_rank=2 + tp, world=4)
    report = compare(tmp_path / "ref", tmp_path / "run")
    (pair,) = report.pairs
    assert pair.rank == "0+1+2+3" and report.first_divergence.key == f"layer{last}_mlp", format_report(report)[-1]
    for path in (tmp_path / "run").glob("*.npz"):
        path.unlink()
    # a NaN the first stage meets at decode step 3, the second at the prompt: the run's first is the second's
    handed, _, _ = run_stage(hf, 0, tmp_path / "run", None, monkeypatch, nan_at=3)
    run_stage(hf, 1, tmp_path / "run", handed, monkeypatch, nan_at=0)
    report = compare(tmp_path / "ref", tmp_path / "run")
    first = report.pairs[0].nonfinite["RUN"] or {}
    assert first.get("phase") == "prefill" and first.get("key", "").startswith(f"layer{hf.config.num_hidden_layers // 2}")


def test_data_parallel_replicas_of_a_pipeline_are_separate_sides(tmp_path, monkeypatch):
    """Two data-parallel replicas (`set_parallel(dp_rank=...)`) of a two-stage pipeline: each
    replica's stages merge into one side of its own (`0+1`, `2+3`), never all four into one (the
    review's case: another request's values read as a divergence)."""
    hf = ex.build_model("llama")
    whole_engine_reference(hf, tmp_path / "ref")
    for dp in (0, 1):
        handed, _, _ = run_stage(hf, 0, tmp_path / "run", None, monkeypatch, file_rank=2 * dp, world=4, dp_rank=dp)
        run_stage(hf, 1, tmp_path / "run", handed, monkeypatch, file_rank=2 * dp + 1, world=4, dp_rank=dp)
    report = compare(tmp_path / "ref", tmp_path / "run")
    assert sorted(pair.rank for pair in report.pairs) == ["0+1", "2+3"] and report.exit_status == 0
