"""Expert ids a side did not record, derived from its router logits by the model's routing rule.

An engine's MoE gate often returns its logits alone (vLLM's and SGLang's: `(logits, None)`), its
fused MoE kernel picking the experts out of sight, so `instrument` records the router logits of
every prompt row but no ids. Without them a near-tie routing flip, which a low-precision engine
makes honestly now and then, reads as a divergence of the MoE output after it. Where the other
side recorded the ids, the rule its router declares (plain top-k where it declares none), applied
to this side's logits, gives the experts this side picked if it follows that rule: a flip is then
judged as a recorded one is. A bug in how the engine picks its experts is not seen in derived ids,
which follow the rule: it shows in the MoE output after them, as any bug does. Decode steps get
none (an engine's flat `[tokens, ...]` gate records no step rows), so they keep the routing-flip
allowance; and where the other side's router logits at a step are a near tie, a flip this side
made there unseen could explain more than the allowance: a key of that step that crosses is not
comparable (`unseen_step_flips`), not a divergence.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..format.keys import KeyInfo, router_key_for, step_ids_key_for
from ..format.reader import Dump, Member, Replica, preview
from ..format.routers import TOKEN, UNKNOWN, RouterInfo
from .one_sided import gate_without_ids, held_tags
from .phases import other_side
from .routing import routing_epsilon
from .selection import choice_scores, judgeable, select, selection_gap
from .view import DumpView


class _DerivedReplica(Replica):
    """A derived key's one whole copy, held in memory (no file behind it), named by the ranks whose
    router logits gave it (a merged side's are several files')."""

    def __init__(self, key: str, array: np.ndarray, ranks: list[str]) -> None:
        super().__init__(key, None, [(rank, None) for rank in ranks])
        self._array = array

    def arrays(self) -> list[np.ndarray]:
        return [self._array]


class PickedIdsDump(DumpView):
    """A side seen with the ids it did not record added (`derived`: their keys)."""

    def __init__(self, inner: Dump, arrays: dict[str, np.ndarray], infos: dict[str, KeyInfo]) -> None:
        super().__init__(inner)
        self._arrays = arrays
        # The ranks of the router logits each was derived from (_derive reads their first replica).
        self._ranks = {key: inner.replicas(router_key_for(key))[0].ranks for key in arrays}
        self.derived = set(arrays)
        self.members.update({key: Member(key, np.dtype(np.int32), array.shape, False, "", None)
                             for key, array in arrays.items()})
        self.infos.update(infos)

    def replicas(self, key: str) -> list[Replica]:
        if key in self._arrays:
            return [_DerivedReplica(key, self._arrays[key], self._ranks[key])]
        return self.inner.replicas(key)


def with_picked_ids(ref: Dump, run: Dump) -> tuple[Dump, Dump, list[str]]:
    """`ref` and `run`, each with the prompt ids it lacks and the other holds derived where it can
    be (module docstring), and a note per side that got some."""
    notes = []
    sides = []
    for side, this, other in (("REF", ref, run), ("RUN", run, ref)):
        arrays, infos = _derive(this, other)
        if arrays:
            this = PickedIdsDump(this, arrays, infos)
            notes.append(f"{side} recorded router logits but no expert ids for {preview(sorted(arrays), 4)} (its "
                         f"gates return their logits alone, as vLLM's and SGLang's do): its ids there are derived "
                         f"from its logits by the routing rule of {'RUN' if side == 'REF' else 'REF'}'s routers, so "
                         "a near-tie routing flip is judged; how it picks its experts is checked only by the "
                         "MoE outputs after them")
        sides.append(this)
    return sides[0], sides[1], notes


def _derive(this: Dump, other: Dump) -> tuple[dict[str, np.ndarray], dict[str, KeyInfo]]:
    """The prompt ids keys `other` holds whose tag `this` never recorded, from `this`'s router
    logits of every row, where their shapes fit and the rule is known."""
    held = held_tags(this)
    arrays, infos = {}, {}
    for key, info in other.infos.items():
        router_key = router_key_for(key)
        if (info.kind != "ids" or key not in other.members or info.tag in held or router_key is None
                or router_key not in this.members or this.members[router_key].is_integer):
            continue
        ids_shape, logits_shape = other.members[key].shape, this.members[router_key].shape
        if len(ids_shape) != 2 or len(logits_shape) != 2 or ids_shape[0] != logits_shape[0]:
            continue  # one row of logits (router_rows="one") cannot give every row's picks
        rule = other.router(router_key) or this.router(router_key) or RouterInfo(top_k=ids_shape[1])
        if rule.score in (TOKEN, UNKNOWN) or rule.top_k != ids_shape[1]:
            continue
        try:
            logits = np.asarray(this.replicas(router_key)[0].whole(), np.float64)
        except (OSError, ValueError, KeyError):
            continue
        if not np.isfinite(logits).all():
            continue
        arrays[key] = _pick(rule, choice_scores(rule, logits), np.asarray(other.replicas(key)[0].whole()))
        router_info = this.infos.get(router_key)
        infos[key] = replace(info, tokens=router_info.tokens if router_info else info.tokens,
                             written_phase=router_info.written_phase if router_info else info.written_phase)
    return arrays, infos


def _pick(rule: RouterInfo, scores: np.ndarray, other_ids: np.ndarray) -> np.ndarray:
    """The experts `rule` picks by `scores`, in the other side's order (`_aligned`). Where experts tie
    exactly across the cut (frequent in bf16: 8 bits of mantissa), which one the engine's top-k
    kept is not known: the one the other side did not pick is taken, so that the tie is judged as
    a flip (its gap is the reference's) rather than hidden, and the MoE output after it, which
    follows the engine's actual pick, is not read as a divergence nothing explains."""
    if rule.n_group > 1:  # expert groups: select() masks whole groups first; ties there are left as it breaks them
        return _aligned(select(rule, scores), other_ids)
    rows, experts = scores.shape
    expert = np.broadcast_to(np.arange(experts), (rows, experts))
    theirs = (expert[:, :, None] == other_ids[:, None, :]).any(-1)
    # np.lexsort sorts by its last key first: the score (highest first), then not theirs, then the id
    ranked = np.lexsort((expert, theirs, -scores), axis=-1)
    return _aligned(ranked[:, :rule.top_k], other_ids)


def _aligned(picked: np.ndarray, other_ids: np.ndarray) -> np.ndarray:
    """`picked` reordered per row: the experts the other side also picked in its positions, the
    others in the positions of those it picked instead. The order an engine's kernel keeps is not
    known, so none is invented: only a different set shows (a reordering would be a note about
    nothing the engine did, and could take the root-cause line from a real near tie)."""
    out = np.array(other_ids, dtype=np.int64, copy=True)
    for row in range(out.shape[0]):
        mine, theirs = [int(e) for e in picked[row]], out[row].tolist()
        if len(set(theirs)) != len(mine):  # the other side repeats an id: no positions to keep
            out[row] = mine
            continue
        extra = iter([e for e in mine if e not in theirs])
        out[row] = [e if e in mine else next(extra) for e in theirs]
    return out.astype(np.int32)


def unseen_step_flips(ref: Dump, run: Dump, near_tie: float | None, near_tie_ulps: float) -> dict[int, str]:
    """{decode step: why its keys cannot be judged} for the steps where one side recorded no
    routing (its gates give logits alone) and the other side's router logits of that step are a
    near tie in some layer (module docstring)."""
    unseen: dict[int, str] = {}
    for side, have, lacking in (("REF", ref, run), ("RUN", run, ref)):
        lacking_tags = held_tags(lacking)
        for key, info in sorted(have.infos.items(), key=lambda item: (item[1].step or 0, item[1].order)):
            if (info.kind != "step" or info.step is None or info.step in unseen or key not in have.members
                    or not info.tag.endswith("_step_router") or not gate_without_ids(info.tag, lacking, lacking_tags)):
                continue
            ids_key = step_ids_key_for(key)
            width = have.members[ids_key].shape[-1] if ids_key in have.members else None
            rule = have.router(key) or (RouterInfo(top_k=width) if width else None)
            try:
                row = np.asarray(have.replicas(key)[0].whole(), np.float64).reshape(-1)
            except (OSError, ValueError, KeyError):
                continue
            if rule is None or rule.score in (TOKEN, UNKNOWN) or judgeable(rule) or not np.isfinite(row).all() \
                    or rule.top_k >= row.size:
                continue
            gap, epsilon = _flip_gap(rule, row), routing_epsilon(row, near_tie, near_tie_ulps)
            if gap <= epsilon:
                other = other_side(side)
                unseen[info.step] = (f"{other} recorded no routing at this step, where {side}'s {key} is a near tie "
                                     f"(router logit gap {gap:.3g} <= epsilon {epsilon:.3g}): a routing flip "
                                     f"{other} made there unseen could explain it; record {other}'s expert ids of each "
                                     "step to judge it")
    return unseen


def _flip_gap(rule: RouterInfo, row: np.ndarray) -> float:
    """The smallest move of the logits (the tie gap of compare/selection.py) that swaps the
    weakest expert `rule` picks from `row` for the strongest it leaves."""
    scores = choice_scores(rule, row[None])[0]
    picked = select(rule, scores[None])[0]
    left = np.setdiff1d(np.arange(row.size), picked)
    weakest, strongest = picked[np.argmin(scores[picked])], left[np.argmax(scores[left])]
    return selection_gap(rule, row, np.append(picked[picked != weakest], strongest))
