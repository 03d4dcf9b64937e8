"""`compiledump demo`: an engine-style run against a reference run, compared layer by layer.

Both sides run the built-in model (`compiledump.demo.model`) from the same weights and inputs:

- reference: eager, float32, an unpadded batch of one, as a reference implementation would;
- engine: `torch.compile(fullgraph=True)`, a profile run under `profiling()`, a wide warm-up
  decode, and a padded decode batch (the real request in row 0); on CUDA also bfloat16 and
  the decode step in a CUDA graph (`torch.cuda.graph`, or Inductor's `reduce-overhead`).

Each side writes its own dump; the comparator then names the first divergent layer and decode
step. `--inject-bug LAYER` breaks one layer of the engine side the way real bring-up bugs do.
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from pathlib import Path

PROMPT_LEN = 7
PAD_ROWS = 3


class DemoError(Exception):
    """Bad demo options (reported by the CLI as one line, exit status 2)."""


def _start_dump(directory: Path, layers: int) -> None:
    import torch

    import compiledump

    torch._dynamo.reset()
    compiledump.reset()
    # Keep every layer's MoE internals (the default keeps 2) and gate on the prompt length.
    compiledump.configure(dir=str(directory), tokens=PROMPT_LEN, moe_layers=layers)


def _quiet_flush() -> str:
    # The comparator's report lists each side's drops; flush()'s warnings would repeat them.
    import warnings

    import compiledump

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return compiledump.flush()


def engine_forward(engine, mode: str | None = None):
    """`engine` compiled as the demo's engine side runs it: fullgraph, the token count dynamic from
    the first call (`with_dynamic_token_count`). Against `dynamic=True` (every dim symbolic) the
    cold compile of the default demo took 73 s instead of 89 s on 2 cores, for the same graphs and
    verdict. `mode="reduce-overhead"` is Inductor's CUDA graphs: each call starts a step, and its
    outputs are cloned (the next replay overwrites them)."""
    import torch

    from .model import with_dynamic_token_count

    forward = with_dynamic_token_count(torch.compile(engine, fullgraph=True, mode=mode))

    def replayed(*args):
        torch.compiler.cudagraph_mark_step_begin()
        return tuple(t.clone() for t in forward(*args))

    return replayed if mode == "reduce-overhead" else forward


def _progress(log, label: str, steps: int):
    started = time.perf_counter()

    def on_step(step: int) -> None:
        if step + 1 == steps or (step + 1) % max(1, steps // 4) == 0:
            elapsed = time.perf_counter() - started
            log(f"[demo]   {label}: decode step {step + 1}/{steps} ({elapsed:.1f} s since its start, compiles included)")

    return on_step


def _capture_path() -> str:
    # What ran the captures (native or python on CPU): the manifest's capture_path.
    from ..capture.state import STATE

    return STATE.runtime.capture_path if STATE.runtime is not None else "none"


def run_demo(
    layers: int = 6,
    steps: int = 16,
    device: str = "cpu",
    inject_bug: int | None = None,
    bug: str = "dropped_hc",
    graphs: str | None = None,
    out: str | None = None,
    dtype: str | None = None,
    log=print,
) -> int:
    """Run reference and engine, compare them, print the report; return the comparator's exit
    status (0 no divergence, 1 divergence, 3 could not tell everything)."""
    import torch
    from torch._dynamo.utils import counters

    import compiledump

    from ..compare import CompareOptions, compare, format_report
    from .model import ModelConfig, Session, TinyMoE, make_session, run_session, run_session_cuda_graph

    try:
        dev = torch.device(device)
    except RuntimeError:
        raise DemoError(f"unknown device {device!r}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise DemoError("--device cuda, but CUDA is not available on this machine")
    if dev.type not in ("cpu", "cuda"):
        raise DemoError(f"--device {device}: the demo runs on cpu or cuda")
    if graphs is None:
        graphs = "cuda-graph" if dev.type == "cuda" else "none"
    if graphs != "none" and dev.type != "cuda":
        raise DemoError(f"--graphs {graphs} needs --device cuda")
    engine_dtype = getattr(torch, dtype) if dtype else (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    if inject_bug is not None and not 0 <= inject_bug < layers:
        raise DemoError(f"--inject-bug {inject_bug} is not a layer of a {layers}-layer model")

    out_dir = Path(out) if out else Path(tempfile.mkdtemp(prefix="compiledump-demo-"))
    log(f"[demo] dumps in {out_dir}")
    cfg = ModelConfig(layers=layers, captures_per_layer=3)
    engine_session = make_session(cfg, prompt_len=PROMPT_LEN, steps=steps, pad_rows=PAD_ROWS).to(dev)
    reference_session = Session(
        prompt=engine_session.prompt,
        decode_tokens=engine_session.decode_tokens,
        pad_tokens=engine_session.pad_tokens[:, :0],
        pad_state=engine_session.pad_state[:, :0],
        profile_tokens=engine_session.profile_tokens,
    )

    log(f"[demo] reference: eager, float32, batch of 1, {layers} layers, prompt {PROMPT_LEN}, {steps} decode steps")
    _start_dump(out_dir / "reference", layers)
    reference = TinyMoE(cfg, dump=compiledump).to(dev)
    run_session(reference, compiledump, reference_session, device=dev, engine=False,
                on_step=_progress(log, "reference", steps))
    reference_path = _quiet_flush()

    engine_cfg = dataclasses.replace(cfg, bug_layer=-1 if inject_bug is None else inject_bug, bug=bug)
    mode = "reduce-overhead" if graphs == "reduce-overhead" else None
    what = f"torch.compile(fullgraph=True{', mode=reduce-overhead' if mode else ''}), {str(engine_dtype)[6:]}"
    what += f", padded decode batch of {1 + PAD_ROWS}"
    if graphs == "cuda-graph":
        what += ", decode in torch.cuda.graph"
    if inject_bug is not None:
        what += f", BUG injected in layer {inject_bug} ({bug})"
    log(f"[demo] engine: {what}")
    _start_dump(out_dir / "engine", layers)
    engine = TinyMoE(engine_cfg, dump=compiledump).to(dev, engine_dtype)
    forward = engine_forward(engine, mode)

    counters.clear()
    graphs_at_first_step = []
    on_step = _progress(log, "engine", steps)

    def engine_step(step: int) -> None:
        if step == 0:
            graphs_at_first_step.append(counters["stats"]["unique_graphs"])
        on_step(step)

    started = time.perf_counter()
    if graphs == "cuda-graph":
        run_session_cuda_graph(forward, compiledump, engine_session, on_step=engine_step)
    else:
        run_session(forward, compiledump, engine_session, device=dev, on_step=engine_step)
    path = _capture_path()
    engine_path = _quiet_flush()
    compiled_graphs = counters["stats"]["unique_graphs"]
    breaks = sum(counters["graph_break"].values())
    log(
        f"[demo] engine: {compiled_graphs} compiled graph(s), {breaks} graph break(s), "
        f"{compiled_graphs - graphs_at_first_step[0]} recompile(s) after the first decode step"
        + (f", {counters['inductor']['cudagraph_skips']} cudagraph skip(s)" if mode else "")
        + f" ({time.perf_counter() - started:.1f} s); capture path: {path}"
    )

    log(f"[demo] compiledump compare {reference_path} {engine_path}")
    report = compare(reference_path, engine_path, CompareOptions())
    for line in format_report(report, table="divergent"):
        log(line)
    return report.exit_status
