"""`instrument()` on an engine built as vLLM and SGLang build their models, against the Hugging Face
model it was loaded from (examples/vllm_style_engine.py: flat tokens, the residual add deferred to
a fused add-RMSNorm, `(logits, None)` gates, a logits processor beside a never-called lm_head).

Before, an honest fp32 engine of this shape was "first divergence: layer0_attn" (the attention
output recorded as the residual stream, the MLP output as the layer's), had no logits, and an
honest bf16 MoE engine exited 1 where bf16 rounding flipped a near tie (its gates give no ids).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torch._dynamo.utils import counters

pytest.importorskip("transformers")

from compiledump.cli import main  # noqa: E402
from compiledump.compare import picked  # noqa: E402
from compiledump.format.reader import DumpFile  # noqa: E402
from helpers.hf_example import ex  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


engines = _load("vllm_style_engine")
_dump, pair = engines.dump, engines.run_pair


def compare(tmp_path, capsys):
    code = main(["compare", str(tmp_path / "ref"), str(tmp_path / "run"), "--json", str(tmp_path / "r.json")])
    return code, capsys.readouterr().out.splitlines(), json.loads((tmp_path / "r.json").read_text())


def _arrays(directory: Path) -> dict:
    with np.load(next(directory.glob("*.npz"))) as data:
        return {key: data[key] for key in data.files}


@pytest.mark.parametrize("name, sglang", [("llama", False), ("qwen3_moe", False), ("mixtral", False), ("llama", True)])
def test_an_honest_engine_records_the_residual_stream_and_its_logits(tmp_path, capsys, name, sglang):
    hf, engine, prompt = pair(tmp_path, name, sglang=sglang)
    # The residual stream, independently: Hugging Face's own layer outputs and its post-attention
    # norm's input, hooked on the reference model (the prompt's last token).
    seen = {}

    def keep(tag, tensor) -> None:  # a hook that returns None leaves the module's inputs and output
        seen[tag] = tensor[0, -1].clone()

    hooks = [layer.post_attention_layernorm.register_forward_pre_hook(
        lambda _m, args, i=i: keep(f"layer{i}_attn", args[0])) for i, layer in enumerate(hf.model.layers)]
    hooks += [layer.register_forward_hook(
        lambda _m, _a, out, i=i: keep(f"layer{i}", out)) for i, layer in enumerate(hf.model.layers)]
    with torch.no_grad():
        hf(input_ids=prompt[None], use_cache=False)
    for hook in hooks:
        hook.remove()
    run = _arrays(tmp_path / "run")
    for key in ("layer0_attn", "layer1_attn", "layer0", "layer3"):
        np.testing.assert_allclose(run[key], seen[key].numpy(), rtol=1e-4, atol=1e-5, err_msg=key)
    assert {f"logits_{n}" for n in range(5)} <= run.keys()  # from the logits processor
    assert not any(key.startswith("input_token") for key in run)  # flat ids: not recorded
    code, lines, report = compare(tmp_path, capsys)
    assert code == 0, lines[-1]
    assert lines[-1].startswith("no divergence: ")
    compared = {record["key"] for record in report["keys"] if record.get("status") == "ok"}
    assert {"layer0_attn", "layer0", "layer3", "final_norm", "logits_4", "layer0_step_1", "layer3_step_4"} <= compared
    # A layer's state at step 0 is the prefill's first token here (the flat step row), the
    # reference's last: not compared (the prompt's layer<i> holds it)
    assert not any(record["key"].endswith("_step_0") and "router" not in record["key"] for record in report["keys"])
    assert not any(p["kind"] == "missing_in_run" for p in report["problems"]), report["problems"]
    assert any(line.startswith("note: only REF recorded the tokens its steps fed (5 input_token_<n>") for line in lines)


@pytest.mark.parametrize("bug, key", [("norm_eps", "layer1_mlp"), ("rope_base", "layer0_mixer"),
                                      ("decode_position", "layer0_mixer_step_1")])
def test_an_engine_bug_is_named_where_it_starts(tmp_path, capsys, bug, key):
    pair(tmp_path, "llama", bug=bug)
    code, lines, report = compare(tmp_path, capsys)
    assert code == 1 and report["first_divergence"]["key"] == key, lines[-1]


def test_a_near_tie_the_engine_s_gate_flipped_is_judged_from_its_logits(tmp_path, capsys):
    """Seed 11's bf16 engine flips a near tie in layer 1 at the last token (router logits 0.349 vs
    0.347). Its gates give no ids: they are derived from its router logits, the flip judged a near
    tie, exit 0 (before: "first divergence: layer1_mlp", exit 1)."""
    pair(tmp_path, "qwen3_moe", seed=11, dtype=torch.bfloat16)
    code, lines, report = compare(tmp_path, capsys)
    assert code == 0, lines[-1]
    records = {record["key"]: record for record in report["keys"]}
    assert records["layer1_topk"]["status"] == "near_tie" and records["layer1_topk"]["routing"]["near_tie_rows"] == [6]
    notes = report["notes"]
    assert any(note.startswith("RUN recorded router logits but no expert ids for layer0_topk, layer1_topk")
               for note in notes), notes
    # The engine lacks each step's routing: the note names record_step for both kinds it lacks
    # (before: "no expert ids", and record_ids('layer<i>_topk'), which the engine already had)
    (lacking,) = [note for note in notes if note.startswith("RUN recorded no routing (expert ids or a step's router "
                                                            "logits) where REF did (20 keys: layer0_step_router_0")]
    assert lacking.endswith("record RUN's with compiledump.record_step('layer<i>_step_router', router_logits, "
                            "moe_filtered=True) and compiledump.record_step('layer<i>_step_topk', topk_ids, "
                            "moe_filtered=True) (a step's rows: the request's row, as set_gather_rows(step=...) "
                            "names it)"), lacking


def test_a_bug_in_how_the_engine_weighs_experts_is_still_found(tmp_path, capsys):
    """Derived ids follow the rule: a fused MoE that renormalises its top-k weights where the model
    does not shows in the MoE output after them."""
    pair(tmp_path, "qwen3_moe", seed=3, dtype=torch.bfloat16, bug="renormalize")
    code, lines, report = compare(tmp_path, capsys)
    assert code == 1 and report["first_divergence"]["key"] == "layer0_mlp", lines[-1]


def test_derived_ids_do_not_prove_a_step_s_routing(tmp_path, capsys):
    """Every layer's routing kept (COMPILEDUMP_MOE_LAYERS=4): the reference's routing is complete,
    the engine's gates recorded none of it, so decode steps keep the routing-flip allowance."""
    pair(tmp_path, "qwen3_moe", dtype=torch.bfloat16, moe_layers=4)
    code, lines, report = compare(tmp_path, capsys)
    assert code == 0, lines[-1]
    sources = {record["key"]: record.get("threshold_source") or "" for record in report["keys"]}
    assert sources["logits_2"] == "calibrated decode"  # not "calibrated decode, no routing flip"


@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v3_grouped"])
def test_derived_ids_are_the_ones_the_model_s_own_router_picks(tmp_path, name):
    """The Hugging Face model's own ids (its router: softmax top-k; DeepSeek-V3's sigmoid + bias in
    expert groups) against those derived from the same logits by its declared rule."""
    hf = ex.build_model(name, seed=2)
    prompt = torch.randint(0, hf.config.vocab_size, (1, 13), generator=torch.Generator().manual_seed(5))
    _dump(hf, tmp_path / "full", lambda: hf(input_ids=prompt, use_cache=False), moe_layers=4)
    full = DumpFile(next((tmp_path / "full").glob("*.npz")))
    arrays = _arrays(tmp_path / "full")
    (tmp_path / "logits").mkdir()
    np.savez(tmp_path / "logits" / "d.npz", **{k: v for k, v in arrays.items() if not k.endswith("topk")})
    derived, _ = picked._derive(DumpFile(tmp_path / "logits" / "d.npz"), full)
    routed = [key for key in arrays if key.endswith("_topk") and "step" not in key]
    assert routed and sorted(derived) == sorted(routed)
    for key in routed:  # in the other side's order: an engine's kernel order is not known
        np.testing.assert_array_equal(derived[key], arrays[key], err_msg=key)


def test_an_exact_tie_across_the_cut_is_the_pick_the_other_side_did_not_make():
    """bf16 logits tie exactly now and then (seed 1 of these engines: 1.6484375 twice in layer 1);
    which expert the engine's top-k kept is unknown, so the derived pick is the one that shows a
    flip, judged against the reference's gap, instead of ids "equal" beside an MoE output that
    follows the other expert. Rows without a tie are the plain top-k."""
    from compiledump.compare.selection import choice_scores
    from compiledump.format.routers import RouterInfo

    logits = np.array([[0.5, 1.6484375, 1.6484375, -1.0], [2.0, 1.0, 0.5, 0.0], [0.1, 0.3, 0.3, 0.3]])
    rule = RouterInfo(top_k=2)
    scores = choice_scores(rule, logits)
    # in the other side's order, a pick it did not make in the place of the one it made instead
    np.testing.assert_array_equal(picked._pick(rule, scores, np.array([[0, 1], [1, 0], [1, 2]])),
                                  [[2, 1], [1, 0], [1, 3]])  # row 2: three tied, 3 is not theirs
    np.testing.assert_array_equal(picked._pick(RouterInfo(top_k=1), choice_scores(RouterInfo(top_k=1), logits),
                                               np.array([[1], [0], [2]])), [[2], [0], [1]])
    # an ids row that repeats an expert has no positions to keep: the picks as ranked
    np.testing.assert_array_equal(picked._pick(rule, scores, np.array([[5, 5], [1, 0], [1, 2]]))[0], [1, 2])


def test_the_compiled_engine_records_what_the_eager_one_does(tmp_path):
    """torch.compile(fullgraph=True) traces the stream readers (no graph break): the same prefill
    values as eager, the layer outputs and the post-attention norms' summed inputs.

    Dynamo's trace of the readers is what this checks, so the graph runs on the aot_eager backend:
    AOT autograd's functionalized graph with the capture ops in it, without Inductor's codegen (14
    CPU kernels, each a g++ run, cold). Llama's Inductor engines, whose residual stream after
    attention, layer outputs, final norm and logits are captured from fused kernels and held to
    float32 thresholds, are tests/capture/test_hf_models.py's."""
    hf = ex.build_model("llama", seed=4)
    engine = engines.ForCausalLM(hf).eval()
    prompt = torch.randint(0, hf.config.vocab_size, (9,), generator=torch.Generator().manual_seed(6))
    positions = torch.arange(9)

    def prefill(forward):
        def run():
            for layer in engine.model.layers:
                layer.self_attn.cache = None
            engine.compute_logits(forward(prompt, positions)[-1:])
        return run

    torch._dynamo.reset()
    # A 4 MiB arena for both dumps (each is tens of KB; a dropped key fails the key check below): on
    # aot_eager, which does not reinplace, every functionalized capture copies the whole arena.
    _dump(engine, tmp_path / "eager", prefill(engine), arena_mb=4)
    counters.clear()
    _dump(engine, tmp_path / "compiled", prefill(torch.compile(engine, fullgraph=True, backend="aot_eager")),
          arena_mb=4)
    assert counters["stats"]["unique_graphs"] == 1  # traced and compiled, not skipped to eager
    torch._dynamo.reset()
    eager, compiled = _arrays(tmp_path / "eager"), _arrays(tmp_path / "compiled")
    assert {"layer0_attn", "layer1_attn", "layer0", "layer3", "final_norm", "logits_0"} <= eager.keys() == compiled.keys()
    for key in eager:
        np.testing.assert_allclose(compiled[key], eager[key], rtol=1e-5, atol=1e-6, err_msg=key)


def test_sglang_s_topk_module_records_the_engine_s_own_picks(tmp_path, capsys):
    """SGLang's MoE block picks its experts in a `topk` module: its `topk_ids` are recorded as
    `layer<i>_topk` (nothing derived), and seed 11's bf16 near tie is judged from them."""
    _, engine, prompt = pair(tmp_path, "qwen3_moe", seed=11, dtype=torch.bfloat16, sglang=True)
    picks = {}  # the prefill's picks again, hooked independently

    def keep(i, out) -> None:  # returns None: the module's output stays
        picks[i] = out.topk_ids.clone()

    hooks = [engine.model.layers[i].mlp.topk.register_forward_hook(lambda _m, _a, out, i=i: keep(i, out))
             for i in (0, 1)]
    with torch.no_grad():
        engine.generate(prompt, [])
    for hook in hooks:
        hook.remove()
    run = _arrays(tmp_path / "run")
    for i in (0, 1):
        np.testing.assert_array_equal(run[f"layer{i}_topk"], picks[i].numpy())
    code, lines, report = compare(tmp_path, capsys)
    assert code == 0, lines[-1]
    assert {record["key"]: record["status"] for record in report["keys"]}["layer1_topk"] == "near_tie"
    assert not any("derived" in note for note in report["notes"]), report["notes"]


def test_a_decode_flip_the_engine_s_gates_hid_is_not_read_as_a_divergence(tmp_path, capsys):
    """Mixtral seed 4, every layer's routing kept: at decode step 2 the reference's layer-0 router
    is a near tie (gap 0.003) and the bf16 engine's gates record no step routing; logits_2 crosses
    the decode-step allowance (2.3e-1 > 2e-1), as a flip there would make it. Not comparable, exit
    3 (before: "first divergence: logits_2", exit 1), with the fix named."""
    pair(tmp_path, "mixtral", seed=4, dtype=torch.bfloat16, moe_layers=4)
    code, lines, report = compare(tmp_path, capsys)
    assert code == 3, lines[-1]
    records = {record["key"]: record for record in report["keys"]}
    assert records["logits_2"]["status"] == "not_comparable"
    assert "layer0_step_router_2 is a near tie" in records["logits_2"]["reason"]
    assert records["logits_3"]["status"] == "ok"  # the steps after it are judged
    # (the layers' states at step 2 that cross too are named in the same line)
    assert any(line.startswith("not comparable: decode step 2 (") and "logits_2): RUN recorded no routing at this step"
               in line and line.endswith("record RUN's expert ids of each step to judge it") for line in lines), lines
