"""What one-row mode cannot see: a prefill divergence that other token rows may have reached first.

In one-row mode (``COMPILEDUMP_ROWS=one``, the default) a prefill key holds the prompt's last
token only; router logits are the exception (``instrument`` keeps every row). A bug that changes
other tokens first (an expert the last token does not use, a causal mask that lets a token see
the next one) is invisible until attention mixes those tokens into the last one, or until an
every-row key shows them. The first divergence is then right about where the last token first
differs, and the bug may sit earlier: this note says so, and how to find where it begins.
"""

from __future__ import annotations

from .key_record import KeyRecord
from .report import Divergence
from .table import rows_text

ROWS_FIX = "record every row (COMPILEDUMP_ROWS=all) to name where it begins"


def one_row_note(records: list[KeyRecord], first: Divergence | None,
                 prompt: int | None) -> tuple[str, bool] | None:
    """A note when ``first`` (a prefill float divergence) may come from token rows no earlier key
    recorded, and whether the first divergence should carry a caution (only where an every-row key
    shows other tokens diverging first: a one-row key after attention is more often right about
    its own layer, as a wrong norm or attention there is), or None."""
    if first is None or first.phase != "prefill" or first.metric in ("ids", "argmax") or (
            prompt is not None and prompt < 2):  # a one-token prompt has no other tokens
        return None
    key = records[first.position]
    before = [r for r in records[:first.position] if r.phase == "prefill" and r.floats is not None]
    last_ok = next((r for r in reversed(before) if r.status == "ok"), None)
    if key.rows is not None:
        # An every-row key diverging at other tokens but not the last, after a last good key that
        # held the last token only: those tokens may have diverged before it, unseen.
        last = len(key.rows.rel_diff) - 1
        if not key.divergent_rows or last in key.divergent_rows or last_ok is None or last_ok.rows is not None:
            return None
        return (f"{key.key} diverges at {rows_text(key.divergent_rows, len(key.rows.rel_diff))} but not at the "
                f"last, the only token {last_ok.key} (last good) holds (one-row mode): those tokens may have "
                f"diverged before it; {ROWS_FIX}"), True
    layer = key.layer if key.layer is not None else -1
    crossed = (last_ok is not None and last_ok.layer is not None and layer > last_ok.layer) or (
        last_ok is None and layer >= 1)
    if not (layer >= 1 and (key.tag.endswith(("_attn", "_mixer")) or crossed)):
        return None  # no attention between the last good key and this one: the last token's own path
    seen = next((r for r in reversed(before) if r.status == "ok" and r.rows is not None), None)
    since = (f"whose rows were last seen agreeing at {seen.key} (every row)" if seen is not None
             else "which no earlier key records")
    return (f"{key.key} holds the prompt's last token only (one-row mode), and attention mixes in the other "
            f"tokens, {since}: the bug may be at those tokens in an earlier layer, not only in layer {layer}; "
            f"{ROWS_FIX}"), False
