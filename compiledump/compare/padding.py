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
never compared: one side may have had none (a model called without `attention_mask`). A
sparse-attention indexer's scores and picks have the padding among their keys (its positions in
the cache), at every step: those are not compared either. The side is unpadded where it is read,
before `--map` renames its keys; its note is one of the side's own.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..format import spec
from ..format.keys import chosen
from ..format.reader import Dump, KeyProblem, Replica
from .phases import tokens_text
from .view import DumpView


class _SlicedReplica(Replica):
    """A per-token key's copy, its rows `first:end` (the real positions)."""

    def __init__(self, inner: Replica, first: int, end: int) -> None:
        super().__init__(inner.key, inner.shard, inner.parts)
        self._inner, self._first, self._end = inner, first, end

    def arrays(self) -> list[np.ndarray]:
        return [array[self._first:self._end] for array in self._inner.arrays()]


class UnpaddedDump(DumpView):
    """A side seen without its prompt mask and, where the mask pads the request row, without the
    padding (module docstring)."""

    def __init__(self, inner: Dump, mask: np.ndarray | None) -> None:
        super().__init__(inner)
        mask_key = spec.PROMPT_MASK_TAG  # held by instrument's side: consumed here, never compared
        self.problems = [problem for problem in inner.problems if problem.key != mask_key]
        for held in (self.bad_members, self.members, self.infos):
            held.pop(mask_key, None)
        self.excluded.discard(mask_key)
        self._sliced: dict[str, tuple[int, int]] = {}  # per-token keys: their real rows
        self.span = _span(mask, inner)  # (first real position, end, prompt positions), or None
        if self.span is None:
            return
        first, end, positions = self.span
        for key, info in inner.infos.items():
            member = self.members.get(key)
            if member is None:
                continue
            if chosen(info.tag) == "keys":  # an indexer's: the padding is among its keys
                self._refuse(key, "a sparse-attention indexer's scores or picks, the padding among its keys",
                             first, positions - end)
                continue
            if info.kind == "step" or info.tokens != positions or info.written_phase == "decode":
                if end != positions and info.kind == "step" and info.step == 0 and not spec.prompt_stream_step(key):
                    self._refuse(key, "step 0 holds the prompt's last position, which is padding", first, positions - end)
                continue
            per_token = (info.all_rows or info.kind == "ids") and member.shape and member.shape[0] == positions
            if per_token and any(_token_sharded(copy) for copy in inner.replicas(key)):
                continue  # its ranks' parts split the positions: left as recorded (not comparable)
            self.infos[key] = replace(info, tokens=end - first)
            if per_token:
                self._sliced[key] = (first, end)
                self.members[key] = replace(member, shape=(end - first, *member.shape[1:]))
            elif end != positions:
                self._refuse(key, "holds the prompt's last position, which is padding", first, positions - end)
        if isinstance(self.manifest, dict) and self.manifest.get("prompt_tokens") == positions:
            # the real tokens, as the other side's prompt alone has them; the gate's own width stays
            # known for the fixes that name COMPILEDUMP_TOKENS (phases.gate_length)
            self.manifest = {**self.manifest, "prompt_tokens": end - first, "gate_tokens": positions}
        self.notes.append(_note(first, end, positions))

    def _refuse(self, key: str, what: str, left: int, right: int) -> None:
        del self.members[key]
        self.excluded.add(key)
        fix = "pad the batch on the left (padding_side='left')" if right else "compare a run of the prompt alone"
        self.problems.append(KeyProblem("padded_row", key, f"{what}: its request row is padded ({_padding(left, right)} in "
                                                           f"attention_mask); not compared, fix: {fix}"))

    def replicas(self, key: str) -> list[Replica]:
        copies = self.inner.replicas(key)
        if key not in self._sliced:
            return copies
        first, end = self._sliced[key]
        return [_SlicedReplica(copy, first, end) for copy in copies]


def _span(mask: np.ndarray | None, dump: Dump) -> tuple[int, int, int] | None:
    """(first real position, end, positions) of a mask that pads the prompt's row; None for no
    mask, a mask of another call than the prompt's (its phase decode, or its length not the
    manifest's prompt length), no real position, gaps (not a padded row) or nothing padded."""
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
    """The request row's attention mask a dump that holds `prompt_mask` recorded, or None."""
    try:
        array = np.asarray(dump.replicas(spec.PROMPT_MASK_TAG)[0].whole())
    except (OSError, ValueError):  # unreadable data: the side is compared as recorded
        return None
    return array.reshape(-1) if array.ndim <= 1 else None


def unpadded(dump: Dump) -> Dump:
    """`dump` without its prompt mask, seen on its prompt's real positions where the mask pads the
    request row (module docstring); `dump` itself when it holds no mask."""
    return UnpaddedDump(dump, _mask(dump)) if spec.PROMPT_MASK_TAG in dump.members else dump


def _padding(left: int, right: int) -> str:
    """``3 on the left``, ``1 on the left and 2 on the right``."""
    return " and ".join(f"{count} on the {side}" for count, side in ((left, "left"), (right, "right")) if count)


def _note(first: int, end: int, positions: int) -> str:
    """The side's note: how its request row is padded and what is compared."""
    padded = positions - (end - first)
    if end == positions:
        how = f"left-padded ({padded} of its prompt's {positions} positions masked by attention_mask, as generate " \
              "pads a batch)"
    else:
        how = f"padded ({_padding(first, positions - end)} of its prompt's {positions} positions masked by " \
              "attention_mask)"
    return (f"its request row is {how}: its prompt keys are compared on its "
            f"{tokens_text(end - first).replace('token', 'real token')}"
            + ("; its last position, which one-row keys and step 0 hold, is padding (problems)"
               if end != positions else ""))
