"""A request row of a padded batch: the prompt positions its attention mask leaves out.

Hugging Face `generate` on a batch pads the shorter prompts on the left (zeros in the 2-D
`attention_mask`), so the request's prefill has more positions than the same prompt run alone,
and its keys would be "not comparable" (different token counts) although every real position
computes the same values. `instrument` records the request row's mask (`prompt_mask`, ids of the
prompt's call). On a side that holds one, the prompt is the mask's real positions: per-token
prefill keys (every row, ids) keep those rows, every prefill key of the prompt's call counts that
many tokens, and the manifest's `prompt_tokens` too, so the rest of the comparator sees the
prompt run alone. A row padded on the right ends in padding, the position one-row keys and
step 0 hold: those keys are not compared (a problem each, naming the fix). The mask itself is
never compared: one side may have had none (a model called without `attention_mask`).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..format import spec
from ..format.reader import Dump, KeyProblem, Replica


class _SlicedReplica(Replica):
    """A per-token key's copy, its rows `first:end` (the real positions)."""

    def __init__(self, inner: Replica, first: int, end: int) -> None:
        super().__init__(inner.key, inner.shard, inner.parts)
        self._inner, self._first, self._end = inner, first, end

    def arrays(self) -> list[np.ndarray]:
        return [array[self._first:self._end] for array in self._inner.arrays()]


class UnpaddedDump(Dump):
    """A side seen without its prompt mask and, where the mask pads the request row, without the
    padding (module docstring)."""

    def __init__(self, inner: Dump, mask: np.ndarray | None) -> None:
        self.inner = inner
        self.path, self.label = inner.path, inner.label
        self.merged_ranks = inner.merged_ranks
        self.notes, self.problems = list(inner.notes), list(inner.problems)
        self.bad_members, self.excluded = inner.bad_members, set(inner.excluded)
        self.members = {key: member for key, member in inner.members.items() if key != spec.PROMPT_MASK_TAG}
        self.infos = {key: info for key, info in inner.infos.items() if key != spec.PROMPT_MASK_TAG}
        self.manifest = inner.manifest
        self._sliced: dict[str, tuple[int, int]] = {}  # per-token keys: their real rows
        self.span = _span(mask, inner)  # (first real position, end, prompt positions), or None
        if self.span is None:
            return
        first, end, positions = self.span
        for key, info in inner.infos.items():
            member = self.members.get(key)
            if member is None or info.kind == "step" or info.tokens != positions or info.written_phase == "decode":
                continue
            per_token = (info.all_rows or info.kind == "ids") and member.shape and member.shape[0] == positions
            if per_token and any(_token_sharded(copy) for copy in inner.replicas(key)):
                continue  # its ranks' parts split the positions: left as recorded (not comparable)
            self.infos[key] = replace(info, tokens=end - first)
            if per_token:
                self._sliced[key] = (first, end)
                self.members[key] = replace(member, shape=(end - first, *member.shape[1:]))
            elif end != positions:
                self._refuse(key, "holds the prompt's last position", positions - end)
        if end != positions:
            for key, info in inner.infos.items():
                if info.kind == "step" and info.step == 0 and key in self.members:
                    self._refuse(key, "step 0 holds the prompt's last position", positions - end)
        if isinstance(self.manifest, dict) and self.manifest.get("prompt_tokens") == positions:
            self.manifest = {**self.manifest, "prompt_tokens": end - first}

    def _refuse(self, key: str, what: str, padding: int) -> None:
        del self.members[key]
        self.excluded.add(key)
        self.problems.append(KeyProblem("padded_row", key, f"{what}, padding ({padding} zeros end its attention_mask): "
                                                           "not compared; fix: pad the batch on the left "
                                                           "(padding_side='left')"))

    def replicas(self, key: str) -> list[Replica]:
        copies = self.inner.replicas(key)
        if key not in self._sliced:
            return copies
        first, end = self._sliced[key]
        return [_SlicedReplica(copy, first, end) for copy in copies]

    def router(self, key: str):
        return self.inner.router(key)


def _span(mask: np.ndarray | None, dump: Dump) -> tuple[int, int, int] | None:
    """(first real position, end, positions) of a mask that pads the prompt's row; None for no
    mask, a mask of another call than the prompt's (the token gate off), no real position, gaps
    (not a padded row) or nothing padded."""
    if mask is None:
        return None
    info = dump.infos.get(spec.PROMPT_MASK_TAG)
    prompt = (dump.manifest or {}).get("prompt_tokens")
    if (info is not None and info.written_phase == "decode") or (isinstance(prompt, int) and prompt != mask.size):
        return None
    real = np.flatnonzero(mask)
    if not real.size or real[-1] - real[0] + 1 != real.size or real.size == mask.size:
        return None
    return int(real[0]), int(real[-1]) + 1, int(mask.size)


def _token_sharded(copy: Replica) -> bool:
    """Whether the ranks' parts of `copy` are slices of its positions (concatenated along dim 0)."""
    return copy.shard is not None and copy.shard.how == "concat" and copy.shard.dim == 0


def _mask(dump: Dump) -> np.ndarray | None:
    """The request row's attention mask the dump holds (`prompt_mask`), or None."""
    if spec.PROMPT_MASK_TAG not in dump.members:
        return None
    array = np.asarray(dump.replicas(spec.PROMPT_MASK_TAG)[0].whole())
    return array.reshape(-1) if array.ndim <= 1 else None


def without_padding(ref: Dump, run: Dump) -> tuple[Dump, Dump, list[str]]:
    """`ref` and `run` without their prompt masks, each seen on its prompt's real positions where
    its mask pads the request row; a note per side that was."""
    sides, notes = [], []
    for side, dump in (("REF", ref), ("RUN", run)):
        if spec.PROMPT_MASK_TAG not in dump.members:
            sides.append(dump)
            continue
        unpadded = UnpaddedDump(dump, _mask(dump))
        if unpadded.span is not None:
            first, end, positions = unpadded.span
            masked = f"{positions - end + first} of its prompt's {positions} positions masked by attention_mask"
            if end == positions:
                notes.append(f"{side}'s request row is left-padded ({masked}, as generate pads a batch): its prefill "
                             f"keys are compared as a prompt of its {end - first} real tokens")
            else:
                notes.append(f"{side}'s request row is padded on the right ({first} on the left and {positions - end} "
                             f"on the right: {masked}): its keys of every prompt row are compared on its "
                             f"{end - first} real tokens; its last position, which one-row keys and step 0 hold, "
                             "is padding (problems)")
        sides.append(unpadded)
    return sides[0], sides[1], notes
