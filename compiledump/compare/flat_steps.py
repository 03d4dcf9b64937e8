"""Step 0 of a flat engine's routing steps: not the prompt's last position.

`instrument` records each forward's routing at the token whose logits `logits_<n>` holds
(`<name>_step_router_<n>`, `<name>_step_topk_<n>`): the request's last position of a
`[batch, seq, ...]` model, but of an engine's flat `[tokens, ...]` rows the row
`set_gather_rows(step=...)` names (capture/instrument.py `_step_row`). In a decode step that row is
the request's token; in the prefill (step 0) it is a row of the prompt, row 0 by default (its
first token), while the other side's step 0 is the prompt's last position. Compared, their routers
saw different tokens: a divergence at step 0 that is none. Where one side's step routing came from
flat rows (its manifest's `source_shape` 2-D) and the other's from one row (1-D), its step-0 keys
are left out with one note; the prefill's routing is compared in the prompt keys
(`<name>_router`, `<name>_topk`, every row). Two flat sides keep them: both hold the same row.
(`layer<N>_step_0`, a layer's step state, is never compared, for the same reason: format/spec.py.)
"""

from __future__ import annotations

from ..format import spec
from ..format.reader import Dump, preview

STEP_ROUTING = ("_step_router", "_step_topk")


def flat_step_zero(ref: Dump, run: Dump) -> tuple[set[str], str | None]:
    """The step-0 routing keys both sides hold that are not to be compared (module docstring), and
    the note that says so; (empty, None) where there are none."""
    keys, flat_sides = set(), set()
    for key in ref.members.keys() & run.members.keys():
        info = ref.infos.get(key) or run.infos.get(key)
        if info is None or info.kind != "step" or info.step != 0 or not info.tag.endswith(STEP_ROUTING):
            continue
        flat = {side: _flat(dump, info.tag) for side, dump in (("REF", ref), ("RUN", run))}
        if None not in flat.values() and flat["REF"] != flat["RUN"]:
            keys.add(key)
            flat_sides.add("REF" if flat["REF"] else "RUN")
    if not keys:
        return set(), None
    side = " and ".join(sorted(flat_sides))
    other = "REF" if side == "RUN" else "RUN" if side == "REF" else "the other side"
    return keys, (f"step 0 of the routing steps is not compared ({preview(sorted(keys), 4)}): {side}'s routers ran "
                  f"on flat [tokens, ...] rows, so its step 0 (the prefill) holds the row set_gather_rows(step=...) "
                  f"names, row 0 by default (the prompt's first token), where {other}'s holds the prompt's last "
                  "position; the prefill's routing is compared in the prompt keys (<name>_router, <name>_topk)")


def _flat(dump: Dump, tag: str) -> bool | None:
    """Whether `dump`'s step tag `tag` was captured from 2-D rows (a row gathered by the step
    register), from its manifest's `source_shape` (of the tag's first capture, the same for every
    step); for a `_step_topk` tag without one (ids derived from logits), its `_step_router`'s.
    None where the manifest does not say."""
    keys = (dump.manifest or {}).get("keys")
    if not isinstance(keys, dict):
        return None
    tags = [tag] + ([tag[: -len("_step_topk")] + "_step_router"] if tag.endswith("_step_topk") else [])
    for name in tags:
        entry = keys.get(spec.step_key(name, 0))
        shape = entry.get("source_shape") if isinstance(entry, dict) else None
        if isinstance(shape, list):
            return len(shape) >= 2
    return None


__all__ = ["flat_step_zero"]
