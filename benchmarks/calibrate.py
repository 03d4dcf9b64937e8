"""Calibrate `compiledump compare`'s default thresholds per precision class and phase (docs/compare.md).

Runs the flow of ``examples/hf_reference_vs_compiled.py`` (imported, nothing else but the package):
Hugging Face models built from a config with random weights (Qwen3-MoE, Mixtral, Llama; 4 layers,
hidden 64, 8 experts top-2 for the MoE models), instrumented with ``compiledump.instrument``; the
reference is the float32 model, eager, the request alone, a DynamicCache; the engine runs the same
weights with a StaticCache in float32, bfloat16 or float16, with the request alone (batch 1) or in a
padded batch of 4, eager or ``torch.compile(fullgraph=True)``; both decode the same teacher-forced
tokens. The dumps are compared with ``compiledump.compare.compare`` and default settings, exactly as
``compiledump compare`` does.

Variation: several random weights (``build_model(model, seed=s)``) and prompts (``Inputs(...,
seed=s + 1)``) per model, each with ``initializer_range`` 0.1 (sublayers change the residual stream by
10-50 %, as in a trained model) and 0.02 (the Hugging Face default: a few percent, so bugs inside a
sublayer barely move it). Every engine compiles once: the weights and prompts of the next session
are loaded into it in place, so its graphs are reused; bugs are injected the same way.

Honest pairs: every engine against the float32 reference, one-row dumps (the default), plus eager
padded-batch engines in all-rows mode (``rows="all"``: every prompt row of every record, and the
router logits of every row, so each expert-id mismatch can be judged). Every dump records every MoE
layer's ids (COMPILEDUMP_MOE_LAYERS = the layer count, as docs/compare.md advises for low-precision
MoE comparisons; ``--moe-layers default`` keeps the default 2 for the one-row dumps). Router hooks
log every routing decision of both sides (decode steps included, which no dump records), so each
value is known to come before or after a routing flip. Bugs (compiled padded-batch engines in
one-row mode, and the eager all-rows engines; layer 1, whose ``layer1_mlp`` is recorded under the
default COMPILEDUMP_MOE_LAYERS=2 too): x1.01 of the post-attention norm weight and of every expert (Llama: the MLP) in float32,
x1.05 of every expert in bfloat16 and float16. An fp8 point rounds the float32 eager engine's keys
once to float8_e4m3fn.

Prints, per precision class and phase (prefill keys; decode step keys: the logits of each step),
the largest rel_diff and norm_diff the comparator judged, split into rounding noise (no routing flip
before the key) and values after a routing flip; every honest pair the defaults flag and why; the
router-logit gaps of the expert-id mismatches against the near-tie epsilon; and each bug's values at
its layer with how often the defaults name that layer first.

Usage: python benchmarks/calibrate.py [--seeds 10] [--models qwen3_moe,mixtral,llama] [--inits 0.1,0.02]
       [--steps 6] [--moe-layers all|default] [--no-compile] [--json PATH]
(about 5 minutes on a 2-core CPU box with cold compile caches, 1.5 warm; results in benchmarks/RESULTS.md).
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import math
import os
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

import compiledump
from calibrate_summary import print_summary, summarise
from compiledump.compare import CompareOptions, compare

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("hf_example", REPO / "examples" / "hf_reference_vs_compiled.py")
ex = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ex)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CLASS_OF = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
DEFAULT_MOE_LAYERS = compiledump.get_config().moe_layers  # 2 unless COMPILEDUMP_MOE_LAYERS says otherwise
BUG_LAYER = 1  # layers 0 and 1 record their MLP/MoE output under the default COMPILEDUMP_MOE_LAYERS=2
# (bug, scale) per engine dtype, injected into the compiled padded-batch engines.
BUGS = {"float32": [("norm", 1.01), ("experts", 1.01)], "bfloat16": [("experts", 1.05)],
        "float16": [("experts", 1.05)]}


@dataclass
class Value:
    """One float key of a compared pair (all-rows keys: the largest row values)."""

    key: str
    layer: int | None
    phase: str  # prefill | decode
    rel: float
    norm: float
    after_ids: bool  # after the pair's first differing ids key in model order
    flip: bool | None = None  # a routing flip before it (RoutingLog; None: not logged, compiled engines)
    step: int | None = None
    no_flip: bool = False  # a decode step judged at the prefill defaults: no routing flip can reach it
    moe_output: bool = False  # an MoE block's output at a decode step (its own norm_diff allowance)


@dataclass
class Pair:
    """One compared pair, reduced to what calibration needs."""

    model: str
    init: float
    seed: int
    engine: str  # e.g. "bfloat16 compiled b4"
    klass: str
    rows: str  # one | all
    bug: str | None = None
    values: list[Value] = field(default_factory=list)
    exit_status: int = 0
    first: dict | None = None  # key, layer, phase, metric, value, threshold
    root_cause: dict | None = None  # key, verdict
    ids: list[dict] = field(default_factory=list)  # key, verdict, rows: [row, gap, epsilon]
    flips: list[list[int]] | None = None  # [call, layer, rows differing] from RoutingLog; None: not logged
    excused: int = 0  # float keys not judged at or after tokens whose expert ids differ (compare/flips.py)

    @property
    def label(self) -> str:
        return f"{self.model} init={self.init} seed={self.seed} {self.engine} rows={self.rows}"


class RoutingLog:
    """The expert ids every MoE router of ``model`` picks for the request (batch row 0), per
    forward call: the routing flips a dump does not show (layers above COMPILEDUMP_MOE_LAYERS,
    decode steps). The router hooks keep the latest ids of each layer (a side effect dynamo
    replays after a compiled graph, without a recompile); ``collect`` after each forward call
    files them: a forward hook of the model for the eager reference, a wrapper of the engine's
    (compiled or eager) forward for engines."""

    def __init__(self, model: torch.nn.Module, batch: int) -> None:
        self.batch = batch
        self.calls: list[list[tuple[int, list]]] = []
        self.handles = []
        self.latest: dict[int, torch.Tensor | None] = {}
        for index, layer in enumerate(model.model.layers):
            gate = getattr(getattr(layer, "mlp", None), "gate", None)
            if isinstance(gate, torch.nn.Module):
                self.latest[index] = None
                self.handles.append(gate.register_forward_hook(self._hook(index)))

    def _hook(self, index: int):
        def hook(_module, _inputs, output):
            self.latest[index] = output[2]
        return hook

    def collect(self) -> None:
        if self.latest:
            self.calls.append([(index, ids[: ids.shape[0] // self.batch].tolist())
                               for index, ids in self.latest.items() if ids is not None])

    def after_each_call(self, model: torch.nn.Module) -> None:
        """Collect after every call of ``model`` (an eager model called as a module)."""
        self.handles.append(model.register_forward_hook(lambda *_: self.collect()))

    def wrap(self, forward):
        """``forward`` followed by ``collect`` (an engine's forward, compiled or not)."""
        def wrapped(*args, **kwargs):
            out = forward(*args, **kwargs)
            self.collect()
            return out
        return wrapped

    def take(self) -> list[list[tuple[int, list]]]:
        calls, self.calls = self.calls, []
        return calls

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def flips(ref: list, run: list) -> list[list[int]]:
    """[call, layer, differing rows] for every router call whose ids differ (call 0: the prefill)."""
    out = []
    for call, (ref_layers, run_layers) in enumerate(zip(ref, run)):
        for (layer, a), (_, b) in zip(ref_layers, run_layers):
            rows = sum(1 for x, y in zip(a, b) if x != y)
            if rows:
                out.append([call, layer, rows])
    return out


def after_flip(found: list[list[int]] | None, phase: str, layer: int | None, step: int | None) -> bool | None:
    """Whether a routing flip precedes a key: prefill keys of layer L after any prefill flip in
    a layer <= L (any row: attention mixes them), step n after any flip in the calls <= n."""
    if found is None:
        return None
    if phase == "prefill":
        return any(call == 0 and (layer is None or flip_layer <= layer) for call, flip_layer, _ in found)
    return any(call <= (step or 0) for call, _, _ in found)


def measure(pair: Pair, ref: str, run: str) -> Pair:
    report = compare(ref, run, CompareOptions())
    first_ids = next((record.position for record in report.keys if record.ids_differ), math.inf)
    for record in report.keys:
        if record.floats is None or record.status in ("not_comparable", "shown"):
            continue  # "shown": a decode step's router logits, read to judge its ids only
        if record.excused_rows and record.rows is None:
            continue  # its one row was not judged: a near tie sent that token to other experts
        rel, norm = record.floats.rel_diff, record.floats.norm_diff or 0.0
        if record.rows is not None:  # the rows the comparator judged
            kept = [row for row in range(len(record.rows.rel_diff)) if row not in (record.excused_rows or ())]
            rel = max((record.rows.rel_diff[row] for row in kept), default=0.0)
            norm = max((record.rows.norm_diff[row] or 0.0 for row in kept), default=0.0)
        no_flip = record.limits is not None and "no routing flip" in record.limits.rel_source
        moe_output = record.limits is not None and record.limits.norm_source.endswith("MoE output")
        pair.values.append(Value(record.key, record.layer, record.phase, rel, norm, record.position > first_ids,
                                 after_flip(pair.flips, record.phase, record.layer, record.step), record.step,
                                 no_flip, moe_output))
    pair.excused = sum(1 for record in report.keys if record.excused_rows)
    for record in report.keys:
        if record.ids_differ and record.routing is not None:
            routing = record.routing
            pair.ids.append({"key": record.key, "verdict": routing.verdict, "class": routing.klass,
                             "rows": [[row.row, row.gap, row.epsilon, row.after_near_tie or row.after_unjudged,
                                       row.same_set] for row in routing.rows]})
    pair.exit_status = report.exit_status
    first = report.first_divergence
    if first is not None:
        pair.first = {"key": first.key, "layer": first.layer, "phase": first.phase, "metric": first.metric,
                      "value": first.value, "threshold": first.threshold}
    if report.root_cause is not None:
        pair.root_cause = {"key": report.root_cause.key, "verdict": report.root_cause.routing_verdict}
    return pair


def fp8_point(pair: Pair, ref: str, run: str) -> Pair:
    """One rounding to float8_e4m3fn of the float32 engine's float keys, against the reference
    (no fp8 kernels on a CPU: the noise of the storage format alone). Only for the largest
    initializer_range: with 0.02, sublayer outputs fall below float8_e4m3fn's smallest subnormal
    (2^-9) and flush to zero, which a real fp8 path avoids with per-block scales."""
    from compiledump.compare.metrics import compare_float_arrays
    from compiledump.format.reader import DumpFile

    ref_dump, run_dump = DumpFile(ref), DumpFile(run)
    for key, member in ref_dump.members.items():
        if member.is_integer or key not in run_dump.members:
            continue
        info = ref_dump.infos[key]
        x = ref_dump.array(key).astype("float32")
        y = torch.from_numpy(run_dump.array(key).astype("float32")).to(torch.float8_e4m3fn).float().numpy()
        metrics = compare_float_arrays(x, y)
        pair.values.append(Value(key, info.layer, info.phase, metrics.rel_diff, metrics.norm_diff or 0.0, False,
                                 False, info.step))
    return pair


def weights(model: str, init: float, seed: int) -> dict:
    """The float32 weights of ``model`` built with ``initializer_range`` ``init`` and random seed ``seed``."""
    saved = ex.SIZES["initializer_range"]
    ex.SIZES["initializer_range"] = init
    try:
        return ex.build_model(model, seed).state_dict()
    finally:
        ex.SIZES["initializer_range"] = saved


class Runs:
    """Runs every pair of one model: references first (they reset dynamo), then each engine
    with every (init, seed) loaded in place, then its bugs."""

    def __init__(self, model: str, inits: list[float], seeds: int, steps: int, root: Path,
                 all_moe_layers: bool = True) -> None:
        self.model, self.inits, self.seeds, self.steps, self.root = model, inits, range(seeds), steps, root
        self.all_moe_layers = all_moe_layers
        self.base = ex.build_model(model)
        self.states = {(init, seed): weights(model, init, seed) for init in inits for seed in self.seeds}
        self.count = 0
        self.refs: dict[tuple, str] = {}
        self.ref_routes: dict[tuple, list] = {}
        self.graphs: dict[str, int] = {}

    def inputs(self, seed: int, batch: int):
        return ex.Inputs(self.base.config.vocab_size, self.steps, batch, seed=seed + 1)

    def _dir(self) -> Path:
        self.count += 1
        return self.root / f"{self.model}_{self.count}"

    def moe_layers(self, rows: str) -> None:
        """COMPILEDUMP_MOE_LAYERS of the dumps: every layer's (as docs/compare.md advises for
        low-precision MoE comparisons, so that the comparator sees every prefill routing flip),
        or with --moe-layers default, the default (2) for one-row dumps."""
        every = len(self.base.model.layers)
        compiledump.configure(moe_layers=every if rows == "all" or self.all_moe_layers else DEFAULT_MOE_LAYERS)

    def references(self, rows_modes: list[str]) -> None:
        log = RoutingLog(self.base, 1)
        log.after_each_call(self.base)
        for (init, seed), state in self.states.items():
            self.base.load_state_dict(state)
            for rows in rows_modes:
                self.moe_layers(rows)
                self.refs[init, seed, rows] = ex.run_reference(self.base, self.inputs(seed, 1), self._dir(), rows)
                self.ref_routes[init, seed] = log.take()
        log.remove()  # engines are deep copies of this model: they must not inherit the hooks

    def engine(self, dtype: str, batch: int, compiled: bool, rows: str, bugs=()) -> list[Pair]:
        name = f"{dtype} {'compiled' if compiled else 'eager'} b{batch}"
        self.moe_layers(rows)
        engine = ex.Engine(copy.deepcopy(self.base), self.inputs(0, batch), DTYPES[dtype], rows)
        log = RoutingLog(engine.model, batch)  # before the first (compiling) call: dynamo traces the hooks
        engine.forward = log.wrap(engine.forward if compiled else engine.model.forward)
        out = []
        for (init, seed), state in self.states.items():
            engine.model.load_state_dict(state)
            engine.inputs = self.inputs(seed, batch)
            ref = self.refs[init, seed, rows]
            pair = Pair(self.model, init, seed, name, CLASS_OF[dtype], rows)
            path = engine.run(self._dir())
            pair.flips = flips(self.ref_routes[init, seed], log.take())
            out.append(measure(pair, ref, path))
            if dtype == "float32" and not compiled and batch == 4 and rows == "one" and init == max(self.inits):
                out.append(fp8_point(Pair(self.model, init, seed, "float32 eager b4 rounded once to float8_e4m3fn",
                                          "fp8", rows), ref, path))
            for bug, scale in bugs:
                undo = ex.inject(engine.model, bug, BUG_LAYER, scale)
                try:
                    pair = Pair(self.model, init, seed, name, CLASS_OF[dtype], rows, bug=f"{bug} x{scale}")
                    out.append(measure(pair, ref, engine.run(self._dir())))
                    log.take()
                finally:
                    undo()
        if compiled:
            self.graphs[name] = engine.graphs
        return out


def run_model(model: str, args, root: Path) -> tuple[list[Pair], dict]:
    runs = Runs(model, args.inits, args.seeds, args.steps, root, args.moe_layers == "all")
    runs.references(["one", "all"])
    pairs: list[Pair] = []
    for dtype in DTYPES:
        for batch in (1, 4):
            pairs += runs.engine(dtype, batch, compiled=False, rows="one")
        pairs += runs.engine(dtype, 4, compiled=False, rows="all", bugs=BUGS[dtype])
    if not args.no_compile:
        for dtype in DTYPES:
            pairs += runs.engine(dtype, 4, compiled=True, rows="one", bugs=BUGS[dtype])
    return pairs, runs.graphs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=10, help="random weights and prompts per model and init (default 10)")
    parser.add_argument("--models", default="qwen3_moe,mixtral,llama", help="comma-separated subset")
    parser.add_argument("--inits", default="0.1,0.02", help="initializer_range values (default 0.1,0.02)")
    parser.add_argument("--steps", type=int, default=6, help="decode steps (default 6)")
    parser.add_argument("--no-compile", action="store_true", help="eager engines only (no bugs)")
    parser.add_argument("--moe-layers", choices=("all", "default"), default="all",
                        help="COMPILEDUMP_MOE_LAYERS of the one-row dumps: every layer (default), or the "
                             "default 2 (routing flips in layers 2-3 are then not recorded)")
    parser.add_argument("--json", metavar="PATH", help="also write the summary and every pair as JSON")
    args = parser.parse_args()
    args.inits = [float(value) for value in args.inits.split(",")]
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    warnings.simplefilter("ignore")  # deprecation and dynamo chatter; drops are deliberate here
    started = time.perf_counter()
    pairs: list[Pair] = []
    graphs: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="compiledump_calibrate_") as tmp:
        for model in args.models.split(","):
            model_started = time.perf_counter()
            found, model_graphs = run_model(model, args, Path(tmp))
            pairs += found
            graphs.update({f"{model} {name}": count for name, count in model_graphs.items()})
            print(f"[{model}: {len(found)} pairs, {time.perf_counter() - model_started:.0f} s]", file=sys.stderr)
    compiledump.reset()
    compiledump.configure(dir=None)  # the engines' scratch directories are gone: nothing to flush at exit
    summary = summarise(pairs, BUG_LAYER)
    print_summary(summary, graphs, time.perf_counter() - started, args)
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary, "pairs": [asdict(pair) for pair in pairs]},
                                              indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
