"""Keys that one side holds and the other lacks, sorted by why.

A difference in how the two sides were captured explains most of them, and each such reason is one
note per side instead of a problem per key. Checked in this order, the first that applies wins:
the other side's `instrument(exclude=...)` left the tag out (its manifest's `exclude`, in the
other side's tag names: after `--map`, RUN's tags are renamed to match them, `RenamedDump.left_out_by`);
its COMPILEDUMP_MOE_LAYERS filtered the tag (its manifest's `filtered_tags`: the two settings
differing, or an older compiledump that filtered more); a layer state's step is past its
COMPILEDUMP_LAYER_STEPS (its manifest counts them dropped as `layer_steps`, or the setting is 0);
the other side recorded no sublayer's decode-step state at all (`layer<i>_attn_step`, `_mlp_step`:
a compiledump from before them), or no shared MLP or expert (`layer<i>_shared_mlp`: likewise, or a
fused one), or no token mixer's own output (`layer<i>_mixer`: attention's, likewise); only one side
records the tokens it fed (`input_token`); the other side's router returned its logits alone and
recorded no expert ids (an engine's gate); the steps are shifted (a warm-up before the request, or
the prompt in chunks: overwrites.py), and a side holds steps of a tag past the other side's last.
Any other key of one side is a problem: `missing_in_run` or `extra_in_run` (docs/compare.md).
"""

from __future__ import annotations

import re

from ..format import spec
from ..format.keys import KeyInfo
from ..format.reader import Dump, preview
from .inputs import FED_TAG
from .overwrites import step_count
from .phases import exclude_patterns, layer_steps_of, moe_layers_of, other_side
from .report import Problem


# Tag families a compiledump from before 2026-12-06 did not record: a side holding no key of one
# lacks it by version (the sublayers' decode-step states also by step_states=False), each such key
# of the other side one note per family, not a problem.
NEWER_FAMILIES = {"sublayer_steps": spec.sublayer_step_tag, "shared_mlp": spec.shared_mlp_tag,
                  "mixer": spec.mixer_tag}


class OneSidedKeys:
    """Sorts the keys held by one side of a pair (`sort`), then writes their notes (`notes`).
    `captured`: each side's `phases.not_captured` fact; `shifted`: the two sides' steps are
    misaligned, every step key not comparable (overwrites.py)."""

    def __init__(self, ref: Dump, run: Dump, captured: dict[str, dict | None], shifted: bool = False):
        self.dumps = {"REF": ref, "RUN": run}
        self.shifted = shifted
        # The tags each side's host filter dropped (its manifest's `filtered_tags`), named as the
        # comparator sees that side: the two sides' COMPILEDUMP_MOE_LAYERS differ, or one side was
        # recorded by a compiledump that filtered more (moe_filter_note says which)
        self.filtered = {side: {self.dumps[side].seen_as(tag) for tag in fact["filtered"]} if fact else set()
                         for side, fact in captured.items()}
        self.tags = {side: held_tags(dump) for side, dump in self.dumps.items()}
        self.exclude_patterns = {side: exclude_patterns(dump.manifest) for side, dump in self.dumps.items()}
        self.layer_steps = {side: layer_steps_of(dump.manifest) for side, dump in self.dumps.items()}
        # {reason: {holding side: keys}}: the notes' order (the checks' order is sort's)
        self.explained = {reason: {"REF": [], "RUN": []}
                          for reason in ("filtered", "layer_steps", *NEWER_FAMILIES, "excluded", "fed", "ids",
                                         "shifted", "rows_gate", "ended")}
        # The NEWER_FAMILIES each side recorded any key of
        self.families = {side: {family for family, member_of in NEWER_FAMILIES.items()
                                if any(member_of((spec.split_step_key(key) or (key,))[0]) for key in dump.members)}
                         for side, dump in self.dumps.items()}

    def sort(self, info: KeyInfo, rank: str) -> Problem | None:
        """File `info`'s key (one side holds it) under the reason the other side lacks it; its
        problem if none explains it (None as well for a key the lacking side holds unusably: that
        member's own problem says why)."""
        lacking, holder = ("RUN", "REF") if info.key not in self.dumps["RUN"].members else ("REF", "RUN")
        dump = self.dumps[lacking]
        if info.key in dump.bad_members or info.key in dump.excluded:
            return None
        newer = next((family for family, member_of in NEWER_FAMILIES.items()
                      if member_of(info.tag) and family not in self.families[lacking]), None)
        reason = ("excluded" if dump.left_out_by(info.tag, self.exclude_patterns[lacking])
                  else "filtered" if info.tag in self.filtered[lacking]
                  else "layer_steps" if self._past_layer_steps(info, dump, self.layer_steps[lacking])
                  else newer if newer is not None
                  else "shifted" if self.shifted and self._past_last_step(info, dump)
                  else "fed" if info.tag == FED_TAG
                  else "ids" if gate_without_ids(info.tag, dump, self.tags[lacking])
                  else "rows_gate" if self._rows_gated(info, dump, self.dumps[holder])
                  else "ended" if self._ended(info, dump, self.dumps[holder])
                  else None)
        if reason is not None:
            self.explained[reason][holder].append(info.key)
            return None
        lost = lost_calls(lacking, dump, info.tag, info.kind == "step")
        if lacking == "RUN":
            return Problem("missing_in_run", rank, f"present in REF only{lost}", info.key)
        return Problem("extra_in_run", rank, f"present in RUN only{lost}", info.key)

    @staticmethod
    def _rows_gated(info: KeyInfo, lacking: Dump, holder: Dump) -> bool:
        """Whether `info`, a step the `lacking` side does not hold, is one its rows gate skipped:
        the tag lost no call for another reason, and the gate skipped at least as many calls as
        the steps it lacks (a warm-up's one skipped call does not explain three missing steps)."""
        if info.kind != "step":
            return False
        drops = tag_drops(lacking, info.tag, True)
        if set(drops) - {"rows_gate", "suspended", "token_gate"}:
            return False
        return drops.get("rows_gate", 0) >= step_count(holder, info.tag) - step_count(lacking, info.tag) > 0

    @staticmethod
    def _ended(info: KeyInfo, lacking: Dump, holder: Dump) -> bool:
        """Whether `info` is a step past the `lacking` side's last step of its tag, which no loss
        of that side explains (its prompt-phase gates aside, and a rows gate that skipped no more
        calls than the other side's: a warm-up both skipped): that side ran fewer decode steps."""
        drops = tag_drops(lacking, info.tag, True)
        lost = set(drops) - {"suspended", "token_gate", "rows_gate"}
        gated = drops.get("rows_gate", 0) > tag_drops(holder, info.tag, True).get("rows_gate", 0)
        return OneSidedKeys._past_last_step(info, lacking) and not lost and not gated

    def fewer_steps(self) -> str | None:
        """For the verdict's last line: which side ran fewer decode steps, or None."""
        sides = [side for side, keys in self.explained["ended"].items() if keys]
        if not sides:
            return None
        return "; ".join(f"{other_side(side)} ran fewer decode steps than {side} ({len(self.explained['ended'][side])} "
                         f"step keys of {side} past them not judged)" for side in sides)

    @staticmethod
    def _past_last_step(info: KeyInfo, lacking: Dump) -> bool:
        """Whether `info` is a step of a tag the lacking side holds too, past its last step of it
        (steps are appended from 0, so the last is the count's)."""
        return info.kind == "step" and 0 < step_count(lacking, info.tag) <= info.step

    @staticmethod
    def _past_layer_steps(info: KeyInfo, lacking: Dump, cap: int | None) -> bool:
        """Whether `info` is a layer state's step that the `lacking` side did not keep for
        its COMPILEDUMP_LAYER_STEPS `cap`: none kept (0), or the step past the cap and such steps
        counted dropped (a side that ran fewer forwards is not told to change its setting)."""
        if info.kind != "step" or info.step is None or not spec.stream_step_tag(info.tag) or cap is None:
            return False
        entry = ((lacking.manifest or {}).get("tags") or {}).get(spec.tag_entry_name(info.tag, step=True))
        drops = entry.get("drops") if isinstance(entry, dict) else None
        # 0: instrument recorded none (a hand-written tag of such a name keeps COMPILEDUMP_MAX_STEPS)
        none_recorded = cap == 0 and step_count(lacking, info.tag) == 0
        return none_recorded or (info.step >= cap > 0 and isinstance(drops, dict) and bool(drops.get("layer_steps")))

    def notes(self) -> list[str]:
        """One line per reason and side. (A side whose steps are shifted holds more fed tokens,
        not a side that records none: no note for those.)"""
        manifests = (self.dumps["REF"].manifest, self.dumps["RUN"].manifest)
        write = {"filtered": lambda side, keys: moe_filter_note(side, keys, *manifests),
                 "layer_steps": lambda side, keys: past_layer_steps_note(side, keys, self.layer_steps),
                 "sublayer_steps": lambda side, keys: (
                     f"{side} holds {len(keys)} sublayer decode-step keys ({preview(keys, 3)}) and {other_side(side)} "
                     "none (recorded by a compiledump from before they were, or with step_states=False): not "
                     "compared; record both sides with the same version to judge each step's sublayers"),
                 "shared_mlp": lambda side, keys: (
                     f"{side} holds {len(keys)} keys of a shared MLP or expert of an MoE layer ({preview(keys, 3)}) and "
                     f"{other_side(side)} none (recorded by a compiledump from before they were, or an engine that "
                     "runs the shared expert inside its fused experts: SGLang's num_fused_shared_experts): not "
                     "compared; record both sides with the same version to judge them"),
                 "mixer": lambda side, keys: (
                     f"{side} holds {len(keys)} keys of a token mixer's own output ({preview(keys, 3)}) and "
                     f"{other_side(side)} none (attention's, recorded by a compiledump from before it was): not "
                     "compared; record both sides with the same version to judge them"),
                 "excluded": lambda side, keys: excluded_note(side, keys, self.exclude_patterns),
                 "fed": lambda side, keys: None if self.shifted else one_sided_fed_note(side, keys),
                 "ids": one_sided_ids_note,
                 "shifted": lambda side, keys: (f"{side} holds {len(keys)} step keys past the other side's last step "
                                                f"of their tags (the steps are shifted, not comparable): "
                                                f"{preview(keys, 4)}"),
                 "ended": lambda side, keys: (
                     f"{side} holds {len(keys)} decode-step keys past {other_side(side)}'s last step of their tags "
                     f"({preview(keys, 3)}): {other_side(side)} ran fewer decode steps (it ended early, was killed "
                     "or hung, or its dump was flushed before the end), so only the steps both hold are judged"),
                 "rows_gate": lambda side, keys: (
                     f"{side} holds {len(keys)} decode-step keys that {other_side(side)} skipped while its batch was "
                     f"wider than COMPILEDUMP_MAX_ROWS ({preview(keys, 3)}; rows_gate in its manifest's drops): not "
                     f"compared. To judge those steps, raise {other_side(side)}'s COMPILEDUMP_MAX_ROWS to the batch "
                     "the request shares (set_rows gives it the rows the sampler produced)")}
        lines = (write[reason](side, keys) for reason, sides in self.explained.items()
                 for side, keys in sides.items() if keys)
        return [line for line in lines if line is not None]


def one_sided_fed_note(side: str, keys: list[str]) -> str:
    """One line for the fed tokens only `side` recorded (an engine whose flat `[tokens]` input ids
    `instrument` does not record, or one instrumented by hand): not a problem per step, but where
    greedy decoding fed the sides different tokens cannot be told."""
    other = other_side(side)
    return (f"only {side} recorded the tokens its steps fed ({len(keys)} {FED_TAG}_<n> keys): whether the "
            f"sides fed the same tokens cannot be told; feed {other} the tokens {side} fed (teacher forcing), "
            f"or record them on {other} too (compiledump.record_step('{FED_TAG}', ids[:, None]) with `ids` the "
            "forward's flat input ids: each row's id, of which the step's gather row keeps the request's)")


def past_layer_steps_note(side: str, keys: list[str], caps: dict[str, int | None]) -> str:
    """One line for the layer states `side` has at steps past the other side's
    COMPILEDUMP_LAYER_STEPS (`caps`: each side's): not compared, and both settings."""
    other = other_side(side)
    return (f"{side} has {len(keys)} layer-state keys at steps past {other}'s COMPILEDUMP_LAYER_STEPS (REF "
            f"{caps['REF']}, RUN {caps['RUN']}): not compared; set the same COMPILEDUMP_LAYER_STEPS on both sides to "
            f"compare them ({preview(keys, 4)})")


def moe_filter_note(side: str, keys: list[str], ref_manifest: dict | None, run_manifest: dict | None) -> str:
    """One line for the keys `side` has whose tags the other side's host filter dropped: not
    compared, and both settings. At the same setting `side` kept them because its filter did not
    see them so (tags named otherwise before `--map` renamed them, or a compiledump that filters less:
    before 2026-12-06 a layer's `_attn` and a dense layer's `_mlp` past the setting were filtered)."""
    other = other_side(side)
    settings = (moe_layers_of(ref_manifest), moe_layers_of(run_manifest))
    if settings[0] is not None and settings[0] == settings[1]:
        return (f"{side} has {len(keys)} keys whose tags {other}'s MoE layer filter dropped at the same "
                f"COMPILEDUMP_MOE_LAYERS ({settings[0]}): {side}'s filter did not drop them (named otherwise before "
                f"--map, or recorded by a compiledump that filters less: before 2026-12-06 a layer's _attn and a "
                f"dense layer's _mlp past the setting were filtered): not compared ({preview(keys, 4)})")
    return (f"{side} has {len(keys)} keys whose tags {other}'s COMPILEDUMP_MOE_LAYERS (REF "
            f"{settings[0]}, RUN {settings[1]}) filtered: not compared; set the "
            f"same COMPILEDUMP_MOE_LAYERS on both sides to compare them ({preview(keys, 4)})")


def excluded_note(side: str, keys: list[str], patterns: dict[str, list[str]]) -> str:
    """One line for the keys only `side` has because the other side's instrument(exclude=...)
    (`patterns`: each side's) left their tags out: not compared, the patterns, and what that hides
    (a bug inside a left-out MoE block of a few percent, in bf16: docs/compiling.md)."""
    other = other_side(side)
    return (f"{side} has {len(keys)} keys whose tags {other}'s instrument(exclude={tuple(patterns[other])!r}) left "
            f"out: not compared ({preview(keys, 4)}); a bug inside those modules is seen only where it moves later "
            "keys past their thresholds")


def held_tags(dump: Dump) -> set[str]:
    """The tags `dump` recorded: those of the keys it holds, and those its manifests list as called
    (every call of one may have been lost, as `arena_full` say: a loss its counts name, not a gate
    that gives no ids)."""
    called = {tag for tag, entry in dump.tag_entries() if entry.get("calls") != 0}
    return called | {info.tag for key, info in dump.infos.items() if key in dump.members}


def tag_drops(dump: Dump, tag: str, step: bool) -> dict[str, int]:
    """{reason: calls} the manifests of `dump` count as dropped of its tag `tag` (named as the
    comparator sees it: `--map` renames RUN's); 0 for "all" (a tag past the table)."""
    drops: dict[str, int] = {}
    for seen, entry in dump.tag_entries():
        if seen == tag and (entry.get("kind") == "step") == step:
            for why, count in (entry.get("drops") or {}).items():
                drops[why] = drops.get(why, 0) + (count if isinstance(count, int) else 0)
    return drops


def lost_calls(side: str, dump: Dump, tag: str, step: bool) -> str:
    """`" (RUN dropped its calls: arena_full=1; ...)"` for a tag whose calls the `side` manifests
    count as dropped, or ''."""
    drops = tag_drops(dump, tag, step)
    if not drops:
        return ""
    return f" ({side} dropped its calls: " + ", ".join(
        f"{why}={count or 'all'}" for why, count in sorted(drops.items())) + "; see the manifest's 'drops')"


def gate_without_ids(tag: str, lacking: Dump, lacking_tags: set[str]) -> bool:
    """Whether `tag` is routing that the `lacking` side never recorded (`lacking_tags`: its
    `held_tags`) while it holds the layer's router logits: its gate returned logits alone (an
    engine's: vLLM, SGLang)."""
    suffix = next((suffix for suffix in spec.ROUTING_SUFFIXES if tag.endswith(suffix)), None)
    return suffix is not None and tag not in lacking_tags and f"{tag[: -len(suffix)]}_router" in lacking.members


def one_sided_ids_note(side: str, keys: list[str]) -> str:
    """One line for the routing only `side` recorded (expert ids, a step's router logits), the other
    side having none of their tags (its routers returned logits alone): not compared, and what that
    leaves untold."""
    other = other_side(side)
    # Each kind of routing tag it lacks (ROUTING_SUFFIXES: the longest first), as the first such tag
    # spells it with its layer made `<i>` (`layer<i>_attn_step_topk` for an attention's routing)
    kinds: dict[str, str] = {}
    for key in keys:
        tag = (spec.split_step_key(key) or (key,))[0]
        kinds.setdefault(next(suffix for suffix in spec.ROUTING_SUFFIXES if tag.endswith(suffix)),
                         re.sub(r"^layer\d+", "layer<i>", tag))
    calls = {"_topk": "compiledump.record_ids('{}', topk_ids)",
             "_step_router": "compiledump.record_step('{}', router_logits, moe_filtered=True)",
             "_step_topk": "compiledump.record_step('{}', topk_ids, moe_filtered=True)"}
    fixes = [calls[suffix].format(kinds[suffix]) for suffix in calls if suffix in kinds]
    rows = (" (a step's rows: the request's row, as set_gather_rows(step=...) names it)"
            if kinds.keys() & {"_step_router", "_step_topk"} else "")
    what = "expert ids" if "_step_router" not in kinds else "routing (expert ids or a step's router logits)"
    return (f"{other} recorded no {what} where {side} did ({len(keys)} keys: {preview(keys, 4)}): not "
            f"compared, so a routing flip there cannot be told from a bug. A router that returns its logits "
            f"alone records no ids, nor each step's routing (a gate returning (logits, None), as vLLM's and "
            f"SGLang's do, whose fused MoE picks the experts): record {other}'s with " + " and ".join(fixes) + rows)
