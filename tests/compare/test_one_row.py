"""One-row mode's blind spot: a prefill divergence other token rows may have reached first.

Synthetic fp32 dumps laid out as `instrument` records them in one-row mode (hidden states of the
prompt's last token, router logits of every row): the RUN side is changed where a bug would
change it, and the note must appear exactly when attention could have carried an unseen earlier
change into the first divergent key, or when an every-row key diverges at other tokens only after
a one-row last good key (then with a caution on the first divergence: positive evidence). Seen in a trial: two
experts swapped in layer 1 (used by earlier tokens only) were first seen at layer 2 with "last good:
layer1", and a causal mask off by one at layer0_router with "last good: layer0_attn".
"""

from __future__ import annotations

import numpy as np
import pytest

from helpers import dumpfactory as factory
from compiledump.compare import compare, format_report

TOKENS, DIM, EXPERTS, LAYERS = 7, 24, 8, 3


def captures(rng: np.random.Generator) -> list[factory.Capture]:
    caps = []
    for layer in range(LAYERS):
        router = rng.standard_normal((TOKENS, EXPERTS)).astype(np.float32)
        ids = np.argsort(-router, axis=1)[:, :2].astype(np.int32)
        caps += [factory.Capture(f"layer{layer}_attn", rng.standard_normal(DIM).astype(np.float32), "record",
                                 f"layer{layer}_attn"),
                 factory.Capture(f"layer{layer}_router", router, "record", f"layer{layer}_router"),
                 factory.Capture(f"layer{layer}_topk", ids, "ids", f"layer{layer}_topk"),
                 factory.Capture(f"layer{layer}_mlp", rng.standard_normal(DIM).astype(np.float32), "record",
                                 f"layer{layer}_mlp"),
                 factory.Capture(f"layer{layer}", rng.standard_normal(DIM).astype(np.float32), "record",
                                 f"layer{layer}")]
    return caps


def changed(caps: list[factory.Capture], keys: dict[str, list[int] | None]) -> list[factory.Capture]:
    """RUN: each key in `keys` scaled by 1.01 (an every-row key at the rows listed; None: whole)."""
    out = []
    for cap in caps:
        array = cap.array.copy()
        if cap.key in keys:
            rows = keys[cap.key]
            if rows is None:
                array *= np.float32(1.01)
            else:
                array[rows] *= np.float32(1.01)
        out.append(factory.replace(cap, array=array))
    return out


def run(tmp_path, keys, all_rows: bool = False):
    rng = np.random.default_rng(3)
    ref = captures(rng)
    fields = {f"layer{layer}_router": {"rows": "all", "tokens": TOKENS} for layer in range(LAYERS)}
    if all_rows:  # every hidden state too: then nothing is unseen
        ref = [factory.replace(c, array=np.stack([rng.standard_normal(DIM).astype(np.float32)
                                                  for _ in range(TOKENS - 1)] + [c.array]))
               if c.array.ndim == 1 else c for c in ref]
        fields.update({c.key: {"rows": "all", "tokens": TOKENS} for c in ref if c.array.ndim == 2
                       and not c.key.endswith("topk")})
    paths = factory.write_pair(tmp_path, ref, changed(ref, keys), key_fields=fields)
    report = compare(*paths)
    notes = [note for note in report.notes if "one-row mode" in note]
    return report, notes


def test_a_one_row_key_after_attention_may_carry_an_earlier_bug(tmp_path):
    report, notes = run(tmp_path, {"layer2_attn": None, "layer2_router": None, "layer2": None})
    first = report.first_divergence
    assert first.key == "layer2_attn" and first.last_good == "layer1"
    assert notes == ["layer2_attn holds the prompt's last token only (one-row mode), and attention mixes in the "
                     "other tokens, whose rows were last seen agreeing at layer1_router (every row): the bug may be "
                     "at those tokens in an earlier layer, not only in layer 2; record every row "
                     "(COMPILEDUMP_ROWS=all) to name where it begins"]
    # A note, no caution: a one-row key after attention is as often right about its own layer
    # (a wrong norm or attention there), which a trial's bugs showed.
    assert "caution" not in format_report(report)[-1]


def test_every_row_key_diverging_at_other_tokens_after_a_one_row_last_good(tmp_path):
    report, notes = run(tmp_path, {"layer0_router": [0, 1, 2, 3, 4, 5]})
    assert (report.first_divergence.key, report.first_divergence.last_good) == ("layer0_router", "layer0_attn")
    assert notes == ["layer0_router diverges at tokens 0, 1, 2, 3, 4, 5 of 7 but not at the last, the only token "
                     "layer0_attn (last good) holds (one-row mode): those tokens may have diverged before it; "
                     "record every row (COMPILEDUMP_ROWS=all) to name where it begins"]
    # Other tokens seen diverging first: the verdict itself carries the caution.
    assert format_report(report)[-1].endswith("caution: one-row mode: the bug may sit earlier, at other tokens "
                                              "(see the note)")


@pytest.mark.parametrize("keys", [
    {"layer1_mlp": None, "layer1": None},  # after layer1_router (every row): the last token's own MLP
    {"layer1_router": [2, 6], "layer1_mlp": None},  # an every-row key diverging at the last token too
    {"layer0_attn": None},  # layer 0's attention: nothing before it but the embeddings
])
def test_no_note_where_the_last_tokens_own_path_explains_it(tmp_path, keys):
    report, notes = run(tmp_path, keys)
    assert report.first_divergence is not None and notes == []
    assert "caution" not in format_report(report)[-1]


def test_no_note_in_all_rows_mode(tmp_path):
    report, notes = run(tmp_path, {"layer2_attn": [3], "layer2": [3]}, all_rows=True)
    assert report.first_divergence.key == "layer2_attn" and notes == []
