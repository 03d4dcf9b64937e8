"""Phase honesty end to end: a padded-decode engine against a batch-1 reference, the built-in model,
both dumped by the capture runtime. With the token gate off, `record` keeps each side's last
write, a decode step of one token (reference) or of a padded batch of four whose last row is
padding (engine): never a divergence, "not comparable" with the fix, exit 3. With the default
(COMPILEDUMP_TOKENS=auto) both keep the prompt: no divergence, exit 0."""

import json
from pathlib import Path

import pytest

import compiledump
from compiledump.cli import main
from compiledump.demo.model import ModelConfig, TinyMoE, make_session, run_session

CFG = ModelConfig(layers=3, captures_per_layer=3)


def _dumps(tmp_path, tokens):
    session = make_session(CFG, prompt_len=7, steps=4, pad_rows=3)
    reference_session = type(session)(prompt=session.prompt, decode_tokens=session.decode_tokens,
                                      pad_tokens=session.pad_tokens[:, :0], pad_state=session.pad_state[:, :0],
                                      profile_tokens=session.profile_tokens)
    paths = []
    for name, run, engine in (("reference", reference_session, False), ("engine", session, True)):
        compiledump.reset()
        compiledump.configure(dir=str(tmp_path / name), tokens=tokens, moe_layers=CFG.layers)
        run_session(TinyMoE(CFG, dump=compiledump), compiledump, run, engine=engine)
        paths.append(compiledump.flush())
    return paths


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_token_gate_off_is_not_comparable(dump_dir, tmp_path, capsys):
    reference, engine = _dumps(tmp_path, tokens=0)
    manifest = json.loads(Path(engine).with_suffix(".json").read_text())
    assert (manifest["keys"]["layer1"]["tokens"], manifest["keys"]["layer1"]["phase"]) == (4, "decode")
    assert (manifest["keys"]["layer1_topk"]["tokens"], manifest["keys"]["layer1_topk"]["phase"]) == (7, "prefill")
    assert main(["compare", reference, engine]) == 3
    out = capsys.readouterr().out
    assert "first divergence" not in out and "COMPILEDUMP_TOKENS" in out


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_default_auto_gate_keeps_the_prompt(dump_dir, tmp_path, capsys):
    reference, engine = _dumps(tmp_path, tokens="auto")
    manifest = json.loads(Path(engine).with_suffix(".json").read_text())
    assert manifest["prompt_tokens"] == 7 and manifest["keys"]["layer1"]["phase"] == "prefill"
    assert main(["compare", reference, engine]) == 0
    assert "no divergence" in capsys.readouterr().out
