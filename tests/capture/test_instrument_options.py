"""`instrument()`'s options and misuse, `record()`'s reading of a 3-D tensor, and the note at exit when none ran."""

import os
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

import compiledump
from helpers.hf_dump import forward_hidden as _forward, load_dump as _load
from helpers import forked
from helpers.hf_example import ex


def test_explicit_taps_inputs_and_remove(dump_dir):
    model = ex.build_model("llama")
    ids = torch.randint(0, model.config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(5))
    seen = {}
    hook = model.model.layers[0].self_attn.q_proj.register_forward_hook(lambda _m, a, o: seen.update(x=a[0], y=o))
    handle = compiledump.instrument(model, {"layer{i}_q": "model.layers.{i}.self_attn.q_proj",
                                            "layer0_qin": "model.layers.0.self_attn.q_proj:input"}, defaults=False)
    _forward(model, ids)
    hook.remove()
    assert set(handle.taps) == {"layer0_q", "layer1_q", "layer2_q", "layer3_q", "layer0_qin"}
    arrays, _ = _load(compiledump.flush())
    np.testing.assert_allclose(arrays["layer0_q"], seen["y"][0, -1].numpy(), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(arrays["layer0_qin"], seen["x"][0, -1].numpy(), rtol=1e-6, atol=1e-6)
    handle.remove()
    compiledump.reset()
    _forward(model, ids)
    assert compiledump.flush() is None  # nothing hooked any more


def test_exclude_leaves_out_tags_and_what_depends_on_them(dump_dir):
    """`exclude` patterns (`{i}`: every layer) leave tags out of the hooks, the taps and the dump,
    with their steps: `layer{i}_mlp` alone; `layer1` with `layer1_step_<n>`; `layer{i}_router`
    with the picks and step routing of every layer. What is kept is captured as without `exclude`.
    The manifest names the patterns, and compared against a dump with every tag, the keys left out
    are one note naming them (either side), not a problem per key."""
    model = ex.build_model("qwen3_moe")
    inputs = ex.Inputs(model.config.vocab_size, steps=2, batch=1)
    patterns = ["layer{i}_mlp", "layer1", "layer{i}_router"]

    def run(name, **kwargs):
        compiledump.reset()
        compiledump.configure(dir=str(dump_dir / name))
        handle = compiledump.instrument(model, **kwargs)
        cache = ex.DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=inputs.prompt, **ex.cache_kwargs(model, cache))
            for n in range(2):
                model(input_ids=inputs.step(n)[:1], **ex.cache_kwargs(model, cache))
        handle.remove()
        path = compiledump.flush()
        return handle, path, *_load(path)

    _, full_path, full, full_manifest = run("full")
    handle, kept_path, kept, manifest = run("kept", exclude=patterns)
    gone = {key for key in full if key.endswith("_mlp") or "_mlp_step_" in key or key == "layer1"
            or key.startswith("layer1_step_") or "_router" in key or "_topk" in key}
    assert {"layer0_mlp", "layer0_mlp_step_1", "layer1", "layer1_step_1", "layer0_router", "layer1_step_topk_1"} <= gone
    assert set(kept) == set(full) - gone and {"layer0", "layer1_attn", "layer0_step_1", "logits_2"} <= set(kept)
    for key in kept:
        np.testing.assert_array_equal(kept[key], full[key], err_msg=key)
    assert not any(tag.endswith(("_mlp", "_mlp_step", "_router", "_topk")) for tag in handle.taps)
    assert "layer1" not in handle.taps and "layer1_step" not in handle.taps and "layer0_step" in handle.taps
    assert manifest["exclude"] == patterns and "exclude" not in full_manifest

    compared = {key for key in full if not (key.startswith("layer") and key.endswith("_step_0"))}  # (never are)
    for ref, run_, side in ((full_path, kept_path, "REF"), (kept_path, full_path, "RUN")):
        report = compiledump.compare.compare(ref, run_)
        (pair,) = report.pairs
        assert not pair.problems and report.exit_status == 0, pair.problems
        (note,) = [note for note in pair.notes if "instrument(exclude=" in note]
        other = "RUN" if side == "REF" else "REF"
        assert note.startswith(f"{side} has {len(gone & compared)} keys whose tags {other}'s instrument(exclude="
                               f"('layer{{i}}_mlp', 'layer1', 'layer{{i}}_router')) left out: not compared"), note
        assert {record.key for record in pair.keys} == compared - gone


def test_exclude_leaves_out_a_sublayer_s_steps_alone(dump_dir):
    """`exclude=("layer{i}_mlp_step",)` keeps each MLP's prompt rows and leaves out its decode steps
    only (before, the pattern was refused though the error listed the tag as attached)."""
    model = ex.build_model("llama")
    inputs = ex.Inputs(model.config.vocab_size, steps=2, batch=1)
    handle = compiledump.instrument(model, exclude=("layer{i}_mlp_step",))
    cache = ex.DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=inputs.prompt, **ex.cache_kwargs(model, cache))
        model(input_ids=inputs.step(0)[:1], **ex.cache_kwargs(model, cache))
    handle.remove()
    arrays, manifest = _load(compiledump.flush())
    assert {"layer1_mlp", "layer1_attn_step_1", "layer1_step_1"} <= arrays.keys()
    assert not any("_mlp_step" in key for key in arrays) and "layer1_mlp_step" not in handle.taps
    assert manifest["exclude"] == ["layer{i}_mlp_step"]


def test_exclude_patterns_must_match_a_tag(dump_dir):
    model = ex.build_model("llama")
    with pytest.raises(ValueError, match=r"'layer{i}_router', 'layer9' match no tag attached \(tags: .*layer{i}_mlp"):
        compiledump.instrument(model, exclude=("layer{i}_router", "layer9", "layer{i}_mlp"))
    with pytest.raises(TypeError, match=r"exclude=\('logits',\)"):
        compiledump.instrument(model, exclude="logits")
    ids = torch.randint(0, model.config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(5))
    _forward(model, ids)
    assert compiledump.flush() is None  # the refused calls left no hook behind
    # Another model's patterns do not reach a later manifest through a refused call.
    compiledump.instrument(ex.build_model("llama"), exclude=("layer{i}_mlp",)).remove()
    with pytest.raises(ValueError):
        compiledump.instrument(model, exclude=("layer9",))
    compiledump.record_step("by_hand", torch.randn(8))
    assert "exclude" not in _load(compiledump.flush())[1]


def test_bad_arguments_are_clear_errors(dump_dir):
    model = ex.build_model("llama")
    with pytest.raises(ValueError, match=r"no module at 'model.layers.{i}.nope' \(.*e.g. 'model'\)"):
        compiledump.instrument(model, {"x{i}": "model.layers.{i}.nope"}, defaults=False)


def test_a_compiled_model_is_retraced_with_the_hooks(dump_dir):
    class Toy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([torch.nn.Linear(6, 6)])
            self.layers[0].self_attn = torch.nn.Identity()

        def forward(self, x):
            return self.layers[0](x)

    toy = Toy()
    compiled = torch.compile(toy, fullgraph=True)
    x = torch.randn(1, 3, 6, generator=torch.Generator().manual_seed(6))
    compiled(x)  # traced without hooks
    with pytest.warns(RuntimeWarning, match="cleared dynamo's caches"):
        compiledump.instrument(compiled)
    expected = compiled(x)
    arrays, _ = _load(compiledump.flush())
    np.testing.assert_allclose(arrays["layer0"], expected[0, -1].detach().numpy(), rtol=1e-6)


def test_record_says_how_it_reads_an_ambiguous_3d_tensor(dump_dir):
    g = torch.Generator().manual_seed(7)
    hidden = torch.randn(1, 7, 64, generator=g)  # [batch, seq, hidden], passed as is
    with pytest.warns(RuntimeWarning, match=r"\[1, 7, 64\] tensor is read as \[tokens, hc_mult, dim\]") as caught:
        compiledump.record("h", hidden)
        compiledump.record("h", hidden)
    assert sum("read as" in str(w.message) for w in caught) == 1  # once per tag
    compiledump.record("flat", hidden, layout="batch_seq_dim")
    compiledump.record("hc", torch.randn(7, 4, 64, generator=g))  # a plausible hc_mult: no warning
    compiledump.record("confirmed", hidden, layout="tokens_hc_dim")
    arrays, _ = _load(compiledump.flush())
    np.testing.assert_allclose(arrays["h"], hidden[0].mean(0).numpy(), rtol=1e-6)  # what the warning said
    np.testing.assert_allclose(arrays["flat"], hidden[0, -1].numpy(), rtol=1e-6)
    with pytest.raises(ValueError, match="layout must be one of"):
        compiledump.record("x", hidden, layout="bsd")
    with pytest.raises(ValueError, match="needs a 3-D tensor"):
        compiledump.record("x", hidden[0], layout="batch_seq_dim")
    with pytest.raises(ValueError, match="does not combine with once=True"):
        compiledump.record("x", hidden[0], once=True, rows="all")


@pytest.mark.parametrize("case, script, expected", [
    ("nothing captured", "compiledump.configure(dir=DIR)", "nothing was captured"),
    ("hooks after compile",
     """
     model = torch.nn.Module()
     model.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4)])
     model.layers[0].self_attn = torch.nn.Identity()
     forward = torch.compile(lambda x: model.layers[0](x))
     forward(torch.randn(2, 4))
     compiledump.configure(dir=DIR)
     compiledump.instrument(model)
     forward(torch.randn(2, 4))  # code traced before instrument(): the hooks never run
     """, "its capture hooks never ran"),
])
def test_silence_is_reported_at_exit(tmp_path, case, script, expected):
    code = "import torch, compiledump\nDIR = " + repr(str(tmp_path)) + "\n" + textwrap.dedent(script)
    # The note comes at exit: a process per case, forked from one that imported torch (helpers/forked.py).
    out = forked.run(["-c", code], timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert expected in out.stderr, out.stderr[-2000:]


def test_no_silence_note_after_a_dump_was_written(tmp_path):
    """A script that flushed its dump and then called reset() (tests, notebooks, one dump per
    request) captured plenty: the exit note "nothing was captured" would be false."""
    code = textwrap.dedent(f"""
        import torch, compiledump
        compiledump.configure(dir={str(tmp_path)!r})
        compiledump.record("h", torch.randn(3, 8))
        print(compiledump.flush())
        compiledump.reset()
        """)
    out = forked.run(["-c", code], timeout=300, cwd=tmp_path)  # as above
    assert out.returncode == 0, out.stderr[-2000:]
    assert Path(out.stdout.strip()).exists()
    assert "nothing was captured" not in out.stderr, out.stderr[-2000:]


def test_silence_is_reported_when_only_the_registers_were_called(tmp_path):
    """An engine runner that only suspends captures and sets rows (its records never ran, or run in
    another process), with COMPILEDUMP_DIR set: the exit note still comes, as after any other call
    (importing the capture calls registers the flush at exit)."""
    code = "import compiledump\nwith compiledump.profiling():\n    pass\ncompiledump.set_rows(1)\n"
    env = {**os.environ, "COMPILEDUMP_DIR": str(tmp_path)}
    out = forked.run(["-c", code], timeout=300, cwd=tmp_path, env=env)  # as above
    assert out.returncode == 0, out.stderr[-2000:]
    assert "nothing was captured" in out.stderr, out.stderr[-2000:]


class _Stack(torch.nn.Module):
    """A decoder `instrument`'s defaults cannot find: its blocks sit in a list named `stack`."""

    def __init__(self, vocab: int = 50, dim: int = 16, depth: int = 3):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.stack = torch.nn.ModuleList(torch.nn.Linear(dim, dim) for _ in range(depth))
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, ids):  # [batch, seq]: causal by a running mean, no cache
        x = self.embed(ids)
        for block in self.stack:
            x = x + torch.tanh(block(x.cumsum(1) / torch.arange(1, x.shape[1] + 1).view(1, -1, 1)))
        return self.head(x)


EXPLICIT = {"layer{i}": "stack.{i}", "logits": "head", "input_token": "embed:input"}


def _decode(model, steps: int = 3, after_prompt=None):
    ids = torch.randint(0, 50, (2, 5), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        for n in range(steps + 1):
            if n == 1 and after_prompt is not None:
                after_prompt()
            ids = torch.cat([ids, model(ids)[:, -1:].argmax(-1)], dim=1)


def test_explicit_taps_named_as_default_tags_record_each_step_as_the_defaults_do(dump_dir):
    """Without record_step, taps record the prompt only. Named `layer{i}`, `logits` or `input_token`,
    they record each forward's step as the default tags do: batch row 0's last position."""
    torch.manual_seed(0)
    model = _Stack().eval()
    seen = {"layer1": [], "logits": [], "ids": []}
    hooks = [model.stack[1].register_forward_hook(lambda _m, _a, out: seen["layer1"].append(out[0, -1].clone())),
             model.head.register_forward_hook(lambda _m, _a, out: seen["logits"].append(out[0, -1].clone())),
             model.embed.register_forward_pre_hook(lambda _m, args: seen["ids"].append(int(args[0][0, -1])))]
    handle = compiledump.instrument(model, EXPLICIT, defaults=False)
    _decode(model)
    arrays, _ = _load(compiledump.flush())
    for hook in hooks:
        hook.remove()
    handle.remove()
    assert set(handle.taps) == {"layer0", "layer1", "layer2", "layer0_step", "layer1_step", "layer2_step",
                                "logits", "input_token"}
    for n in range(4):
        # stack[1]'s own output, before the residual add the model does around it
        np.testing.assert_allclose(arrays[f"logits_{n}"], seen["logits"][n].numpy(), rtol=1e-6, atol=1e-6)
        assert int(arrays[f"input_token_{n}"][0]) == seen["ids"][n]
        np.testing.assert_allclose(arrays[f"layer1_step_{n}"], seen["layer1"][n].numpy(), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(arrays["layer1"], seen["layer1"][0].numpy(), rtol=1e-6, atol=1e-6)


def test_a_decode_only_bug_is_named_at_its_step_through_explicit_taps(dump_dir):
    from compiledump.compare import compare

    torch.manual_seed(0)
    paths = []
    for name in ("ref", "run"):
        model = _Stack().eval()
        compiledump.reset()
        compiledump.configure(dir=str(dump_dir / name))
        handle = compiledump.instrument(model, EXPLICIT, defaults=False)

        def bug(model=model):
            with torch.no_grad():
                model.stack[2].weight.mul_(1.01)
        _decode(model, after_prompt=bug if name == "run" else None)
        paths.append(compiledump.flush())
        handle.remove()
        torch.manual_seed(0)
    report = compare(*paths)
    first = report.first_divergence
    assert report.exit_status == 1 and (first.key, first.step) == ("layer2_step_1", 1)


@pytest.mark.parametrize("via", ["call", "forward"])
def test_a_tap_of_the_token_embeddings_input_keeps_the_requests_ids(dump_dir, via):
    """The token ids tapped at the embedding run before the first layer's hook: a decode step's
    [2, 1] ids were reshaped as the prompt's [2, 5] (a crash); then the prompt's [2, 5] ids were
    kept whole, and their first dim taught the token gate a prompt of 2 tokens, so that no prompt
    record of the 5 tokens was kept. A token embedding's input is [batch, seq] ids: the request's
    row is kept, however the model is called (`model.forward`, as torch.compile(model.forward) is,
    runs no hook of the model itself)."""
    torch.manual_seed(0)
    model = _Stack().eval()
    first = {}
    hook = model.stack[1].register_forward_hook(lambda _m, _a, out: first.update(layer1=out[0, -1].clone())
                                                if not first else None)
    compiledump.instrument(model, {**EXPLICIT, "ids": "embed:input"}, defaults=False)
    ids = torch.randint(0, 50, (2, 5), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        for _ in range(4):
            logits = model(ids) if via == "call" else model.forward(ids)
            ids = torch.cat([ids, logits[:, -1:].argmax(-1)], dim=1)
    hook.remove()
    arrays, manifest = _load(compiledump.flush())
    prompt = torch.randint(0, 50, (2, 5), generator=torch.Generator().manual_seed(3))  # _decode's
    np.testing.assert_array_equal(arrays["ids"], prompt[0].numpy())
    np.testing.assert_array_equal(arrays["layer1"], first["layer1"].numpy())
    assert manifest["prompt_tokens"] == 5 and {"layer1_step_3", "logits_3"} <= arrays.keys()
