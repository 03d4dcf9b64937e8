"""The examples run as documented (on CPU; the CUDA graph runner falls back to eager steps)."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(name):
    return _load(name).main()


def test_instrument_your_model(dump_dir):
    path = _run("instrument_your_model")
    assert Path(path).parent == dump_dir
    with np.load(path) as data:
        assert sorted(data.files) == sorted(
            [f"layer{i}" for i in range(4)] + ["logits"] + [f"logits_{n}" for n in range(5)]
        )
        assert data["layer0"].shape == (32,) and data["logits_4"].shape == (100,)
        # Five different decode steps, not one row written five times.
        assert len({data[f"logits_{n}"].tobytes() for n in range(5)}) == 5


def test_cuda_graph_runner(dump_dir):
    path = _run("cuda_graph_runner")
    with np.load(path) as data:
        # The capture-time warm-up is suspended: exactly the six real steps are kept.
        assert sorted(data.files) == sorted(f"logits_{n}" for n in range(6))


def test_vllm_style_engine(tmp_path, capsys):
    module = _load("vllm_style_engine")
    assert module.main([str(tmp_path / "honest")]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("no divergence: ")
    assert module.main([str(tmp_path / "bug"), "--bug", "renormalize", "--seed", "3"]) == 1
    assert capsys.readouterr().out.splitlines()[-1].startswith("first divergence: layer0_mlp (layer 0)")


def test_hf_example_passes_exclude_to_the_engine_s_instrument(tmp_path, dump_dir):
    """`--exclude` reaches the engine's `instrument()`: a pattern that matches no tag is refused
    there, naming the tags, before anything compiles."""
    module = _load("hf_reference_vs_compiled")
    with pytest.raises(ValueError, match=r"'layer\{i\}_nope' match no tag attached \(tags: .*layer\{i\}_mlp"):
        module.main([str(tmp_path), "--model", "llama", "--steps", "1", "--exclude", "layer{i}_nope"])
