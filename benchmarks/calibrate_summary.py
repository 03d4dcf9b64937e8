"""The summary of benchmarks/calibrate.py: what the compared pairs say about the default thresholds.

``summarise`` reduces the pairs (``calibrate.Pair``) to a JSON-able dict; ``print_summary`` prints
it. The runs, the models and the bug injection stay in calibrate.py.
"""

from __future__ import annotations

import math
import os

import torch

from compiledump.compare.options import DECODE_LAYER, MOE_STEP_FACTOR, phase_thresholds
from compiledump.format import spec


def _phase(value) -> str:
    """The row a judged value belongs to: prefill, decode-nf (judged at the prefill defaults),
    decode-layer (a layer's step state, with its allowance) or decode (the other step keys); an MoE
    block's output at a step, with twice the thresholds, in decode-nf-moe or decode-layer-moe."""
    if value.phase != "decode":
        return value.phase
    moe = "-moe" if value.moe_output else ""
    if value.no_flip:
        return "decode-nf" + moe
    return "decode-layer" + moe if spec.stream_step_key(value.key) else "decode"


def _top(values: list[tuple[float, str]]) -> tuple[float, str]:
    return max(values, default=(0.0, "-"))


def summarise(pairs: list, bug_layer: int) -> dict:
    """The calibration's findings from every compared pair (``calibrate.Pair``): the noise per
    precision class and phase, the honest pairs the defaults flag and why, the expert-id ties, the
    routing flips, and each bug's values at ``bug_layer`` with how often the defaults name it."""
    honest = [pair for pair in pairs if pair.bug is None]
    noise: dict[str, dict] = {}
    for klass in ("fp32", "fp16", "bf16", "fp8"):
        members = [pair for pair in honest if pair.klass == klass]
        # Decode steps are judged at the decode-step defaults (their allowance for routing flips;
        # a layer's state, "decode-layer", its own), or, where no flip can reach them
        # (docs/compare.md), at the prefill defaults: "decode-nf".
        for phase in ("prefill", "decode", "decode-layer", "decode-nf", "decode-layer-moe", "decode-nf-moe"):
            if not members:
                continue
            judged = [(value, pair) for pair in members for value in pair.values if _phase(value) == phase]
            groups = {
                "judged": judged,  # every value the comparator judged
                "rounding": [(v, p) for v, p in judged if v.flip is False and not v.after_ids],
                "flip": [(v, p) for v, p in judged if v.flip is True],
                "after_ids": [(v, p) for v, p in judged if v.after_ids],
            }
            entry = {"pairs": len(members)}
            for name, items in groups.items():
                rel = _top([(value.rel, f"{value.key} {pair.label}") for value, pair in items])
                norm = _top([(value.norm, f"{value.key} {pair.label}") for value, pair in items])
                entry[name] = {"keys": len(items), "rel": rel[0], "rel_at": rel[1], "norm": norm[0], "norm_at": norm[1]}
            for init in sorted({pair.init for pair in members}):
                subset = [value for value, pair in groups["rounding"] if pair.init == init]
                entry[f"rounding init={init}"] = [max((v.rel for v in subset), default=0.0),
                                                  max((v.norm for v in subset), default=0.0)]
            rel_limit, norm_limit = phase_thresholds(
                klass, {"decode-nf": "prefill", "decode-layer": DECODE_LAYER}.get(phase.removesuffix("-moe"), phase))
            if phase.endswith("-moe") and klass != "fp32":
                rel_limit, norm_limit = rel_limit * MOE_STEP_FACTOR, norm_limit * MOE_STEP_FACTOR
            # The thresholds must clear the rounding noise; above it, the values after a routing
            # flip in a decode step (which no dump records) for the decode defaults.
            top = entry["judged"] if phase.startswith("decode") else entry["rounding"]
            entry.update(default_rel=rel_limit, default_norm=norm_limit,
                         margin_rel=rel_limit / top["rel"] if top["rel"] else math.inf,
                         margin_norm=norm_limit / top["norm"] if top["norm"] else math.inf)
            noise[f"{klass} {phase}"] = entry
    flagged = []
    for pair in honest:
        if pair.exit_status != 1:  # 0, or 3: ids that no reference router logits could judge
            continue
        first = pair.first or {}
        value = next((v for v in pair.values if v.key == first.get("key")), None)
        flip = value.flip if value is not None else None
        if first.get("metric") == "ids":
            why = "ids: a divergence (" + ("fp32 class" if pair.klass == "fp32" else "far from a tie") + ")"
        elif pair.root_cause is not None:
            why = f"float key after differing ids ({pair.root_cause['key']}: {pair.root_cause['verdict']})"
        elif flip:
            why = "a routing flip the dump does not record (a decode step, or a layer above COMPILEDUMP_MOE_LAYERS)"
        else:
            why = "FALSE POSITIVE: no routing flip before it"
        flagged.append({"pair": pair.label, "first": pair.first, "why": why})
    ties = []
    for pair in honest:
        for ids in pair.ids:
            for row, gap, epsilon, after, reordered in ids["rows"]:
                ties.append({"pair": pair.label, "key": ids["key"], "row": row, "gap": gap, "epsilon": epsilon,
                             "verdict": ids["verdict"], "class": ids["class"], "after": after,
                             "reordered": reordered})
    logged = [pair for pair in honest if pair.flips is not None]
    routing = {klass: {"pairs": sum(1 for p in logged if p.klass == klass),
                       "with_prefill_flip": sum(1 for p in logged if p.klass == klass and any(f[0] == 0 for f in p.flips)),
                       "with_decode_flip": sum(1 for p in logged if p.klass == klass and any(f[0] > 0 for f in p.flips)),
                       "excused_keys": sum(p.excused for p in honest if p.klass == klass)}
               for klass in ("fp32", "fp16", "bf16")}
    bugs: dict[str, dict] = {}
    for pair in pairs:
        if pair.bug is None:
            continue
        entry = bugs.setdefault(f"{pair.model}: {pair.engine} rows={pair.rows} {pair.bug}", {
            "class": pair.klass, "rel": [], "norm": [], "named": 0, "runs": 0, "misses": []})
        at_layer = [value for value in pair.values if value.layer == bug_layer]
        entry["rel"].append(max((value.rel for value in at_layer), default=0.0))
        entry["norm"].append(max((value.norm for value in at_layer), default=0.0))
        entry["runs"] += 1
        named = pair.first is not None and pair.first["layer"] == bug_layer
        entry["named"] += int(named)
        if not named:
            entry["misses"].append({"pair": pair.label, "first": pair.first, "root_cause": pair.root_cause,
                                    "excused": pair.excused, "exit_status": pair.exit_status})
    return {"bug_layer": bug_layer, "noise": noise, "flagged": flagged, "honest": len(honest),
            "unjudged": sum(1 for pair in honest if pair.exit_status == 3), "ties": ties, "routing": routing, "bugs": bugs,
            "honest_pairs": len(honest), "honest_by_class": {k: sum(1 for p in honest if p.klass == k)
                                                             for k in ("fp32", "fp16", "bf16", "fp8")}}


def print_summary(summary: dict, graphs: dict, elapsed: float, args) -> None:
    """Print ``summarise``'s findings as the tables benchmarks/RESULTS.md quotes."""
    bug_layer = summary["bug_layer"]
    print(f"honest pairs: {summary['honest_pairs']} "
          f"({', '.join(f'{k} {v}' for k, v in summary['honest_by_class'].items())})")
    print()
    print("max rel_diff / norm_diff of the honest float keys the comparator judged, by precision class and phase;")
    print("'rounding': no routing flip before the key (router hooks) and no differing ids before it;")
    print("'after flip': a routing flip before the key (the comparator sees it only where ids are recorded).")
    print("'decode-nf': decode steps judged at the prefill defaults (every route recorded, no token's experts")
    print("differing before them: docs/compare.md); 'decode': the other decode steps, with the routing-flip allowance;")
    print("'decode-layer': the layers' states of those steps (layer<N>_step_<n>, _attn_step, _mlp_step), with")
    print("their own allowance; '-moe': an MoE block's output at a step (layer<N>_mlp_step_<n>), twice the thresholds.")
    print(f"{'class phase':<14} {'rounding':>19} {'after flip':>19} {'all judged':>19}  "
          f"{'default':>13}  margin (prefill: over rounding; decode: over all)")
    for name, entry in summary["noise"].items():
        if not entry["judged"]["keys"]:
            continue  # e.g. fp32 decode-nf: the fp32 decode defaults are the prefill ones
        cells = [f"{entry[g]['rel']:.1e} / {entry[g]['norm']:.1e}" if entry[g]["keys"] else "-"
                 for g in ("rounding", "flip", "judged")]
        print(f"{name:<14} {cells[0]:>19} {cells[1]:>19} {cells[2]:>19}  "
              f"{entry['default_rel']:.0e} / {entry['default_norm']:.0e}  "
              f"x{entry['margin_rel']:.3g} / x{entry['margin_norm']:.3g}")
    print()
    for name, entry in summary["noise"].items():
        if not entry["judged"]["keys"]:
            continue
        print(f"{name}: all judged max rel_diff at {entry['judged']['rel_at']}; max norm_diff at "
              f"{entry['judged']['norm_at']}")
        print(f"{'':<14} rounding max rel_diff at {entry['rounding']['rel_at']}; max norm_diff at "
              f"{entry['rounding']['norm_at']}")
        print(f"{'':<14} rounding by initializer_range (rel / norm) "
              + ", ".join(f"{key[9:]}: {value[0]:.1e} / {value[1]:.1e}" for key, value in entry.items()
                          if key.startswith("rounding init=")))
    print()
    print("routing flips (router hooks; pairs with a flip in the prefill / in a decode step),")
    print("and float keys the comparator did not judge at or after tokens whose expert ids differ:")
    for klass, entry in summary["routing"].items():
        print(f"  {klass}: {entry['pairs']} logged pairs, {entry['with_prefill_flip']} with a prefill flip, "
              f"{entry['with_decode_flip']} with a decode flip; {entry['excused_keys']} keys excused")
    print()
    print(f"honest pairs the defaults flag (exit 1): {len(summary['flagged'])}; that cannot judge every differing "
          f"expert-id row (exit 3): {summary['unjudged']} of {summary['honest']}")
    for item in summary["flagged"]:
        first = item["first"] or {}
        print(f"  {item['pair']}: {first.get('key')} {first.get('metric')} {first.get('value')!s:.9} -- {item['why']}")
    print()
    ties = summary["ties"]
    print(f"differing expert-id rows in honest pairs: {len(ties)}; judged by the reference router logits: "
          f"{sum(1 for t in ties if t['gap'] is not None)}")
    for tie in ties:
        if tie["gap"] is not None:
            row = ("the same experts, reordered" if tie["reordered"]
                   else f"reached by the flip at {tie['after']}" if tie["after"]
                   else "near tie" if tie["gap"] <= tie["epsilon"] else "FAR from a tie")
            print(f"  {tie['pair']} {tie['key']} row {tie['row']}: gap {tie['gap']:.3g} epsilon {tie['epsilon']:.3g} "
                  f"(gap/epsilon {tie['gap'] / tie['epsilon']:.2f}): {row} [{tie['class']} key: {tie['verdict']}]")
    not_judged: dict[tuple, int] = {}
    for tie in ties:
        if tie["gap"] is None:
            not_judged[tie["class"], tie["verdict"]] = not_judged.get((tie["class"], tie["verdict"]), 0) + 1
    if not_judged:
        print("  rows without reference router logits (one-row mode): "
              + ", ".join(f"{klass} {verdict}: {count}" for (klass, verdict), count in sorted(not_judged.items())))
    print()
    print(f"{'bug (value at layer ' + str(bug_layer) + ', min..max)':<67} {'class':<5} {'rel_diff':>19} "
          f"{'norm_diff':>19}  named at layer {bug_layer}")
    for name, entry in summary["bugs"].items():
        rel = f"{min(entry['rel']):.1e}..{max(entry['rel']):.1e}"
        norm = f"{min(entry['norm']):.1e}..{max(entry['norm']):.1e}"
        print(f"{name:<67} {entry['class']:<5} {rel:>19} {norm:>19}  {entry['named']}/{entry['runs']}")
        for miss in entry["misses"]:
            print(f"    missed: {miss['pair']}: exit {miss['exit_status']}, first {miss['first']}, root cause "
                  f"{miss['root_cause']}, {miss['excused']} keys excused")
    print()
    print(f"compiled graphs per engine (2 = prefill + decode, no recompile over the sessions): "
          f"{sorted(set(graphs.values()))} over {len(graphs)} engines")
    print(f"elapsed {elapsed:.0f} s; load average {os.getloadavg()[0]:.1f}; torch {torch.__version__}; "
          f"seeds {args.seeds}, inits {args.inits}, steps {args.steps}, models {args.models}, "
          f"moe layers {args.moe_layers}")
