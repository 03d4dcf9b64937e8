"""Step tags whose numbering a dropped call shifted: their keys are not compared.

`record_step` numbers a tag's keys by its kept calls (`<tag>_<n>`: the n-th kept one; the device
kernel hands out the index as it claims the write). A call dropped for a reason of its own, while
the forward it belongs to ran (`shape_changed`: another payload shape than the first kept call,
such as a step's expert ids of a top-1 forward among top-2 ones; `row_out_of_range`: the gather
row missing from that batch), claims no index, so from it on the tag's key `<n>` holds a later
forward's value: compared with the other side's `<n>`, a difference reads as a divergence at the
wrong step (a helper's audit: a decode-only top-1 at step 3 was named at `layer1_step_topk_4`).
The manifest counts such drops per tag but not at which step, so the tag's steps are not compared
(all of them: a drop at the last call would have shifted nothing), and one line says why. Drops
meant to skip forwards that are not the request's (`suspended` inside profiling(), `rows_gate`
for a warm-up batch above COMPILEDUMP_MAX_ROWS) are left alone: every step tag skips those alike
(a wider batch *during* the request, another request joining, would shift every step tag of that
side; docs/compare.md says so).
"""

from __future__ import annotations

from ..format.reader import Dump

STEP_DROPS = "step numbering shifted"
# Drop reasons of calls made by a forward of the compared request.
SHIFTING = ("shape_changed", "row_out_of_range")


def shifted_step_tags(ref: Dump, run: Dump) -> dict[str, str]:
    """{step tag: why its keys are not comparable} for the step tags either side's manifests (every
    rank's, on a merged side) count shifting drops of (the first side that has some names them)."""
    out: dict[str, str] = {}
    for side, dump in (("REF", ref), ("RUN", run)):
        for tag, entry in dump.tag_entries():  # (tags as the comparator names them: --map renames RUN's)
            if entry.get("kind") != "step":
                continue
            drops = {why: count for why, count in (entry.get("drops") or {}).items()
                     if why in SHIFTING and isinstance(count, int) and count > 0}
            if drops and tag not in out:
                counts = ", ".join(f"{why}={count}" for why, count in sorted(drops.items()))
                out[tag] = (
                    f"{STEP_DROPS}: {side} dropped {sum(drops.values())} call(s) of the step tag {tag} "
                    f"({counts}); its keys are numbered by its kept calls, so from the first dropped one on its "
                    f"<n> holds a later forward's value (fix: give each shape its own tag"
                    + ("; a gather row every decode batch has" if "row_out_of_range" in drops else "") + ")")
    return out
