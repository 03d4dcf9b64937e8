"""How `record` reads a tensor: its layout (which dims are tokens) and which rows it keeps.

A 3-D tensor is ambiguous: the hc_mult models compiledump started with pass `[tokens, hc_mult,
dim]` (stored as the mean over hc_mult), Hugging Face models pass `[batch, seq, hidden]` (every
position a token). `record` keeps the first reading unless told otherwise, and says so when a
stored tensor does not look like it (`check_hc_reading`), so a mean over positions is never
stored silently.
"""

from __future__ import annotations

import warnings

import torch

from ..ops import layout as L
from .state import STATE

TOKENS_HC_DIM = "tokens_hc_dim"  # [tokens, hc_mult, dim]: the mean over hc_mult of the kept row(s)
BATCH_SEQ_DIM = "batch_seq_dim"  # [batch, seq, dim]: flattened to [batch * seq, dim] tokens
LAYOUTS = (TOKENS_HC_DIM, BATCH_SEQ_DIM)
ROWS = ("one", "all")  # the gathered row (set_gather_rows), or every row of the gated prefill
# hc_mult of published hyper-connection models is 2..8; a middle dim above this is something else.
MAX_HC_MULT = 16


def record_kind(tag: str, tensor: torch.Tensor, once: bool, rows: str, layout: str | None):
    """(tensor to capture, capture kind, layout declared) for one `record` call; raises on bad
    arguments. `batch_seq_dim` flattens to `[tokens, dim]` here (a view when the strides allow)."""
    if layout is not None and layout not in LAYOUTS:
        raise ValueError(f"compiledump.record({tag!r}): layout must be one of {LAYOUTS} or None, got {layout!r}")
    if rows not in ROWS:
        raise ValueError(f"compiledump.record({tag!r}): rows must be one of {ROWS}, got {rows!r}")
    if layout is not None and tensor.dim() != 3:
        raise ValueError(f"compiledump.record({tag!r}, layout={layout!r}): needs a 3-D tensor, got shape "
                         f"{tuple(tensor.shape)}")
    if layout == BATCH_SEQ_DIM:
        tensor = tensor.reshape(-1, tensor.shape[-1])
    if rows == "all":
        if once:
            raise ValueError(f"compiledump.record({tag!r}): rows='all' keeps the token-gated prompt; it does not "
                             "combine with once=True")
        if tensor.dim() not in (2, 3):
            # Stored whole anyway: every element of a 1-D or >3-D tensor is kept.
            return tensor, L.KIND_RECORD, layout is not None
        return tensor, L.KIND_RECORD_ROWS, layout is not None
    return tensor, L.KIND_RECORD_ONCE if once else L.KIND_RECORD, layout is not None


def doubtful_hc_reading(shape: tuple, prompt_tokens: int | None) -> bool:
    """True when a 3-D `shape` does not look like `[tokens, hc_mult, dim]`: a middle dim too large
    for hc_mult, one token with several middle rows, or the prompt length in the middle dim
    instead of the first. Its first dim is then no token count to learn a prompt length from."""
    tokens, middle = shape[0], shape[1]
    return (middle > MAX_HC_MULT or (tokens == 1 < middle)
            or (prompt_tokens is not None and tokens != prompt_tokens == middle))


def warned(tag: str) -> bool:
    """True once `check_hc_reading` has warned about `tag`."""
    return (tag, "layout") in STATE.warned


def check_hc_reading(tag: str, shape: tuple, prompt_tokens: int | None) -> None:
    """Warn once per tag when a 3-D tensor about to be stored as `[tokens, hc_mult, dim]` (the
    mean over its middle dim) does not look like one (`doubtful_hc_reading`)."""
    if not doubtful_hc_reading(shape, prompt_tokens) or (tag, "layout") in STATE.warned:
        return
    STATE.warned.add((tag, "layout"))
    warnings.warn(
        f"compiledump.record({tag!r}): a {list(shape)} tensor is read as [tokens, hc_mult, dim] and stored as "
        f"the mean over its {shape[1]} middle rows; if it is [batch, seq, hidden], pass "
        f"layout={BATCH_SEQ_DIM!r} (every position becomes a token row), or layout={TOKENS_HC_DIM!r} to "
        "confirm this reading", RuntimeWarning, stacklevel=2)
