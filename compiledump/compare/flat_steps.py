"""Step 0 of a flat engine's routing steps: not the prompt's last position.

`instrument` records each forward's routing at the token whose logits `logits_<n>` holds
(`<name>_step_router_<n>`, `<name>_step_topk_<n>`): the request's last position of a
`[batch, seq, ...]` model, but of an engine's flat `[tokens, ...]` rows the row
`set_gather_rows(step=...)` names (capture/instrument.py `_step_row`). In a decode step that row is
the request's token; in the prefill (step 0) it is a row of the prompt, row 0 by default (its
first token), while the other side's step 0 is the prompt's last position. Compared, their routers
saw different tokens: a divergence at step 0 that is none.

So where one side's step routing came from several rows (its manifest's `source_shape`, the tag's
first capture outside `profiling()`, has 2 dimensions and more than one row) and the other's from
one row (1-D), that side's step-0 keys of the layer are left out with one note, unless its prompt
keys show that step 0 is the prompt's last row after all (`<name>_router`, every prompt row: its
last row equals `<name>_step_router_0`, as after `set_gather_rows(step=-1)`); the note names the
row it is where they show that. Two flat sides keep them (the same row on both), and so does a
side whose manifest does not say. The same row question for a flat engine's `logits` step (one
whose head computes every token's logits in the prefill) is not handled: no prompt key holds
them to tell (docs/compare.md). (`layer<N>_step_0`, a layer's step state, is never compared:
format/spec.py.)
"""

from __future__ import annotations

import numpy as np

from ..format import spec
from ..format.reader import Dump, preview
from .overwrites import whole_array
from .phases import other_side

ROUTER, IDS = "_step_router", "_step_topk"


def flat_step_zero(ref: Dump, run: Dump, renamed: dict[str, str]) -> tuple[set[str], list[str]]:
    """The step-0 routing keys both sides hold that are not to be compared (module docstring), and
    a note per side that has some; `renamed`: RUN's keys `--map` renamed (new -> old), whose
    manifest entries are under their old names."""
    skipped: dict[str, dict[str, int | None]] = {"REF": {}, "RUN": {}}  # side -> {layer prefix: its row}
    common = ref.members.keys() & run.members.keys()
    for key in sorted(common):
        info = ref.infos.get(key) or run.infos.get(key)
        if info is None or info.kind != "step" or info.step != 0 or not info.tag.endswith(ROUTER):
            continue
        rows = {"REF": _rows(ref, key), "RUN": _rows(run, renamed.get(key, key))}
        flat = [side for side, count in rows.items() if count is not None and count > 1]
        if len(flat) != 1 or rows[other_side(flat[0])] != 0:
            continue
        side = flat[0]
        dump = ref if side == "REF" else run
        prefix = info.tag[: -len(ROUTER)]
        row = _prompt_row(dump, key, prefix + "_router")
        if row != "last":
            skipped[side][prefix] = row
    keys = {side: {spec.step_key(prefix + suffix, 0) for prefix in prefixes for suffix in (ROUTER, IDS)} & common
            for side, prefixes in skipped.items()}
    notes = [_note(side, prefixes, sorted(keys[side]), common) for side, prefixes in skipped.items() if prefixes]
    return keys["REF"] | keys["RUN"], notes


def _rows(dump: Dump, key: str) -> int | None:
    """How many rows the tag of step key `key` was captured from: 0 for a 1-D source (one row
    given, as `instrument` gives of a `[batch, seq, ...]` model), the first dimension of a 2-D or
    wider one; None where the manifest does not say."""
    entry = ((dump.manifest or {}).get("keys") or {}).get(key)
    shape = entry.get("source_shape") if isinstance(entry, dict) else None
    if not isinstance(shape, list) or not shape or not all(isinstance(n, int) for n in shape):
        return None
    return 0 if len(shape) == 1 else shape[0]


def _prompt_row(dump: Dump, step_key: str, router_key: str) -> int | str | None:
    """Which prompt row step 0's router logits are, from the prompt key `router_key` (every row):
    "last", another row's index, or None where it cannot be told."""
    if router_key not in dump.members:
        return None
    step, prompt = whole_array(dump, step_key), whole_array(dump, router_key)
    if step is None or prompt is None or prompt.ndim != 2 or step.shape != prompt.shape[1:]:
        return None
    matches = np.flatnonzero((prompt == step).all(axis=1))
    if not matches.size:
        return None
    return "last" if matches[-1] == prompt.shape[0] - 1 else int(matches[0])


def _note(side: str, prefixes: dict[str, int | None], keys: list[str], common: set[str]) -> str:
    """`side`'s note: its left-out `keys`, the prompt row they hold (`prefixes`: layer prefix ->
    row, None where unknown), and the prompt keys both sides hold (`common`)."""
    found = sorted({row for row in prefixes.values() if row is not None})
    known = len(found) == 1 and None not in prefixes.values()
    row = (f"row {found[0]} of the prompt, which its prompt keys show" if known
           else "the row set_gather_rows(step=...) names, row 0 by default (the prompt's first token)")
    compared = sorted(key for prefix in prefixes for key in (prefix + "_router", prefix + "_topk") if key in common)
    instead = (f"the prefill's routing is compared in the prompt keys ({preview(compared, 4)})" if compared
               else "no prompt key of those layers' routing is held by both sides to compare it instead")
    return (f"step 0 of {side}'s routing steps is not compared ({preview(keys, 4)}): its routers ran on flat "
            f"[tokens, ...] rows, so its step 0 (the prefill) holds {row}, where {other_side(side)}'s holds the "
            f"prompt's last position; {instead}")


__all__ = ["flat_step_zero"]
