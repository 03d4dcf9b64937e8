"""A prompt value that a later forward of the prompt's length replaced on one side (the token gate
lets any forward of that many rows through, and `record` keeps the last write): not comparable,
exit 3, with the fix, instead of a divergence that is not there (compare/overwrites.py).

Before, each of these flows exited 1 at the first prompt key: the flat engine (examples/
vllm_style_engine.py) against its Hugging Face model at `layer0_attn`, the hand-written one at
`layer0`."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

import pytest
import torch

import compiledump
from compiledump import config as cd_config
from compiledump.cli import main

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _side(directory: Path, writes: list[torch.Tensor], logits: torch.Tensor, tokens="auto") -> None:
    """`record("layer0", w)` for each write (the first names the prompt length), then `logits`."""
    compiledump.reset()
    compiledump.configure(**dataclasses.asdict(cd_config.Config(dir=str(directory), tokens=tokens)))
    for write in writes:
        compiledump.record("layer0", write)
    compiledump.record_step("logits", logits)
    compiledump.flush()
    compiledump.reset()


def _compare(tmp_path, capsys):
    code = main(["compare", str(tmp_path / "ref"), str(tmp_path / "run"), "--json", str(tmp_path / "r.json")])
    return code, capsys.readouterr().out.splitlines(), json.loads((tmp_path / "r.json").read_text())


def _engine_pair(tmp_path):
    """examples/vllm_style_engine.py's Llama pair (the reference dumped in tmp_path/ref): the module,
    the Hugging Face model, the flat engine, and the prompt and decode tokens run_pair used."""
    spec = importlib.util.spec_from_file_location("vllm_style_engine", EXAMPLES / "vllm_style_engine.py")
    engines = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(engines)
    hf, engine, prompt = engines.run_pair(tmp_path, "llama")
    g = torch.Generator().manual_seed(100)  # run_pair's prompt and decode tokens (seed 0)
    assert torch.equal(torch.randint(0, hf.config.vocab_size, (7,), generator=g), prompt)
    return engines, hf, engine, prompt, torch.randint(0, hf.config.vocab_size, (4,), generator=g).tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prompt_record_written_again_by_a_forward_of_its_length_is_not_comparable(tmp_path, capsys, dtype):
    g = torch.Generator().manual_seed(0)
    prompt = torch.randn(7, 33, generator=g).to(dtype)
    later = torch.randn(7, 33, generator=g).to(dtype)  # e.g. a decode batch padded to 7 rows
    _side(tmp_path / "ref", [prompt], prompt[-1])
    _side(tmp_path / "run", [prompt, later], prompt[-1])
    code, lines, report = _compare(tmp_path, capsys)
    assert code == 3, lines[-1]
    record = next(record for record in report["keys"] if record["key"] == "layer0")
    assert record["status"] == "not_comparable"
    assert record["reason"].startswith("written again after the prompt: RUN wrote it in 2 forwards of the prompt's "
                                       "7 tokens, REF in 1")
    line = next(line for line in lines if line.startswith("not comparable: 1 prompt keys were written again"))
    assert "compiledump.profiling()" in line and "compiledump.clear()" in line
    # The same flow on both sides (each wrote it twice): compared, equal.
    _side(tmp_path / "ref", [later, prompt], prompt[-1])
    _side(tmp_path / "run", [later, prompt], prompt[-1])
    code, lines, _ = _compare(tmp_path, capsys)
    assert code == 0, lines[-1]


def test_with_the_token_gate_off_every_forward_overwrites_by_design(tmp_path, capsys):
    """COMPILEDUMP_TOKENS=0 (debug_dump.py's behaviour): the last write is what the user asked for."""
    g = torch.Generator().manual_seed(1)
    prompt, later = torch.randn(5, 16, generator=g), torch.randn(5, 16, generator=g)
    _side(tmp_path / "ref", [prompt, later], later[-1], tokens=0)
    _side(tmp_path / "run", [later], later[-1], tokens=0)
    code, lines, report = _compare(tmp_path, capsys)
    assert code == 0 and {r["key"]: r["status"] for r in report["keys"]}["layer0"] == "ok", lines[-1]


def test_a_flat_engine_s_next_request_of_the_prompt_s_length_is_named_not_read_as_a_divergence(tmp_path, capsys):
    """The flat engine runs another 7-token request after the compared one (outside profiling()):
    its layers' records pass the token gate and replace the compared prompt's."""
    engines, hf, engine, prompt, decode = _engine_pair(tmp_path)
    other = torch.randint(0, hf.config.vocab_size, (prompt.numel(),), generator=torch.Generator().manual_seed(9))

    def two_requests() -> None:
        engine.generate(prompt, decode)
        engine.generate(other, [])  # the next request's prefill: a fifth step of RUN's logits

    engines.dump(engine, tmp_path / "run", two_requests)
    code, lines, report = _compare(tmp_path, capsys)
    assert code == 3, lines[-1]
    refused = {r["key"] for r in report["keys"] if r["status"] == "not_comparable"}
    assert {"layer0_attn", "layer0", "layer3", "final_norm"} <= refused
    assert any(line.startswith("not comparable: ") and "prompt keys were written again after the prompt" in line
               and "RUN wrote it in 2 forwards" in line for line in lines), lines
    # Its logits and the layers' states of each step are steps: compared, and they agree.
    statuses = {r["key"]: r["status"] for r in report["keys"]}
    assert statuses["logits_0"] == statuses["logits_4"] == statuses["layer2_step_1"] == "ok"


@pytest.mark.parametrize("engine_kind", ["flat", "hf"])
def test_a_warm_up_before_the_request_shifts_its_steps_and_says_so(tmp_path, capsys, engine_kind):
    """A forward of the prompt's length before the compared request, outside profiling() (a warm-up
    to trigger compilation): the side's steps start with the warm-up's. Before: the flat engine read
    "first divergence: logits_0" (exit 1); the Hugging Face flow, which records the fed tokens,
    exited 3 with a teacher-forcing fix that did not apply."""
    engines, hf, engine, prompt, decode = _engine_pair(tmp_path)
    warm = torch.randint(0, hf.config.vocab_size, (7,), generator=torch.Generator().manual_seed(9))
    if engine_kind == "flat":
        def warm_then_request() -> None:
            engine.generate(warm, [])
            engine.generate(prompt, decode)
        engines.dump(engine, tmp_path / "run", warm_then_request)
    else:
        from transformers import DynamicCache

        def warm_then_request() -> None:
            hf(input_ids=warm[None], use_cache=False)
            cache = DynamicCache(config=hf.config)
            hf(input_ids=prompt[None], cache=cache, use_cache=True)
            for token in decode:
                hf(input_ids=torch.tensor([[token]]), cache=cache, use_cache=True)
        with torch.no_grad():
            engines.dump(hf, tmp_path / "run", warm_then_request)
    code, lines, report = _compare(tmp_path, capsys)
    assert code == 3, lines[-1]
    statuses = {r["key"]: r["status"] for r in report["keys"]}
    assert statuses["logits_0"] == statuses["logits_4"] == "not_comparable"
    line = next(line for line in lines if line.startswith("not comparable: ") and "step keys are shifted" in line)
    evidence = "its fed token at step 1 is the other side's at step 0" if engine_kind == "hf" \
        else "logits_1 matches the other side's logits_0"
    assert "RUN ran 1 forward(s) of the prompt's length before the compared request" in line and evidence in line
    assert not any("teacher forcing" in line for line in lines)
    # its extra step keys (the warm-up's): one note, not a problem each
    assert not [p for p in report["problems"] if p["kind"] == "extra_in_run"], report["problems"]
    assert any(line.startswith("note: RUN holds ") and "past the other side's last step" in line for line in lines), lines
