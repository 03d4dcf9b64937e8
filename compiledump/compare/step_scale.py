"""A decode step's row judged as an all-rows key judges each of its rows (docs/compare.md, "All
rows"): relative to the larger of its own REF norm and the median REF row of the prompt's key at
the same point (``layer3_router`` for ``layer3_step_router_<n>``), when that key holds every
prompt row of the same width. The same row (step 0 repeats a `[batch, seq, hidden]` prompt's
last) then reads the same in both: one token's 8 router logits that nearly cancel are no
divergence at a step either."""

from __future__ import annotations

import zipfile
from dataclasses import replace

import numpy as np

from ..format import spec
from ..format.keys import KeyInfo, prompt_tag_for_step
from ..format.reader import Dump
from .metrics import FloatMetrics, compare_rows


class StepScales:
    """The prompt keys' median REF row squares of one pair, by prompt key: kept when a prompt key
    is measured, else read once when a step needs it."""

    def __init__(self, ref: Dump, chunk: int) -> None:
        self.ref = ref
        self.chunk = chunk
        self._scales: dict[str, tuple[float | None, int | None]] = {}

    def remember(self, info: KeyInfo, scale: float, width: int) -> None:
        """The scale an all-rows prompt key was judged at (``compare_rows``), for its steps."""
        if info.kind != "step" and not spec.masked_scores(info.tag):
            self._scales.setdefault(info.key, (scale, width))

    def floored(self, floats: FloatMetrics, x: np.ndarray, y: np.ndarray, tag: str) -> tuple[FloatMetrics, str | None]:
        """A decode step's ``floats`` (REF row ``x``, RUN row ``y`` of step tag ``tag``) with
        rel_diff and norm_diff taken at its prompt key's row scale; and that prompt key when it
        lowered either metric (else the floats unchanged and None)."""
        prompt = prompt_tag_for_step(tag)
        scale = self._scale(prompt, x.size) if prompt is not None else None
        if scale is None:
            return floats, None
        row = compare_rows(x.reshape(1, -1), y.reshape(1, -1), floor=scale)
        rel, norm = row.rel_diff[0], row.norm_diff[0]
        lower_norm = norm is not None and (floats.norm_diff is None or norm < floats.norm_diff)
        if not (rel < floats.rel_diff or lower_norm):
            return floats, None
        return replace(floats, rel_diff=min(rel, floats.rel_diff),
                       norm_diff=norm if lower_norm else floats.norm_diff), prompt

    def _scale(self, key: str, width: int) -> float | None:
        """The median squared norm of REF's rows of prompt key ``key`` when it is an all-rows
        float key `[tokens, width]`; None otherwise."""
        if key not in self._scales:
            info, member = self.ref.infos.get(key), self.ref.members.get(key)
            scale = None
            if info is not None and info.all_rows and member is not None and not member.is_integer \
                    and len(member.shape) == 2 and not spec.masked_scores(info.tag):
                try:  # of a merged REF, one rank's copy (router logits are replicated, not split)
                    rows = np.asarray(self.ref.replicas(key)[0].whole())
                    # (the scale compare_rows takes, as for the key itself; read here only where the
                    # key was not measured row by row)
                    scale = compare_rows(rows, rows, self.chunk).scale if rows.ndim == 2 else None
                except (OSError, ValueError, IndexError, zipfile.BadZipFile, EOFError):
                    scale = None  # unreadable: the step keeps its own norm
            self._scales[key] = (scale, member.shape[-1] if member is not None and member.shape else None)
        scale, prompt_width = self._scales[key]
        return scale if prompt_width == width and scale else None
