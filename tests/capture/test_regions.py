"""Where captures land in the arena, and the host-side gates, pinned with fixed cases:
16-byte aligned regions, a region that ends exactly at the arena's end, `once=True` and the
token gate. (tests/ops/test_fuzz.py checks the same rules on random sequences.)"""

import json
from pathlib import Path

import numpy as np
import torch

import compiledump
from compiledump.capture.state import STATE

ARENA_WORDS = (1 << 20) // 4  # arena_mb=1


def _manifest(path):
    return json.loads(Path(path).with_suffix(".json").read_text())


def test_regions_are_aligned_and_the_arena_fills_to_its_last_word(dump_dir):
    compiledump.configure(arena_mb=1, tokens=0)  # token counts differ below: no gate
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(2, 3, generator=g), torch.randn(1, 5, generator=g)
    compiledump.record("a", a)  # 3 words at 0
    compiledump.record("b", b)  # 5 words at 4, not 3: regions start on a 4-word boundary
    rest = ARENA_WORDS - 12  # from 12 to the very end of the arena: fits exactly
    last = torch.randn(2, rest, generator=g)
    compiledump.record("last", last)
    compiledump.record("none_left", torch.randn(2, 1, generator=g))
    slots = {slot.tag: slot for slot in STATE.runtime.slots.values()}
    assert [slots[t].offset for t in ("a", "b", "last")] == [0, 4, 12]
    path = compiledump.flush()
    manifest = _manifest(path)
    assert manifest["arena_words_used"] == ARENA_WORDS
    assert manifest["tags"]["last"]["drops"] == {}
    assert manifest["tags"]["none_left"]["drops"] == {"arena_full": 1}
    with np.load(path) as data:
        np.testing.assert_array_equal(data["a"], a[-1].numpy())
        np.testing.assert_array_equal(data["b"], b[-1].numpy())
        np.testing.assert_array_equal(data["last"], last[-1].numpy())


def test_one_word_too_many_does_not_fit(dump_dir):
    compiledump.configure(arena_mb=1, tokens=0)
    g = torch.Generator().manual_seed(4)
    compiledump.record("a", torch.randn(1, 1, generator=g))  # 1 word at 0, next region at 4
    compiledump.record("too_big", torch.randn(1, ARENA_WORDS - 3, generator=g))  # would end at ARENA_WORDS + 1
    manifest = _manifest(compiledump.flush())
    assert manifest["tags"]["too_big"]["drops"] == {"arena_full": 1}


def test_once_ignores_the_token_gate_and_keeps_the_first_write(dump_dir):
    compiledump.configure(tokens=7)
    g = torch.Generator().manual_seed(5)
    first, second = torch.randn(3, 11, generator=g), torch.randn(7, 11, generator=g)
    compiledump.record("logits", first, once=True)  # 3 rows != 7 tokens: kept anyway
    compiledump.record("logits", second, once=True)
    compiledump.record("h", first)  # the token gate applies without once
    compiledump.record("h", second)
    path = compiledump.flush()
    manifest = _manifest(path)
    assert manifest["tags"]["logits"]["drops"] == {} and manifest["tags"]["logits"]["passed"] == 2
    assert manifest["tags"]["h"]["drops"] == {"token_gate": 1}
    with np.load(path) as data:
        np.testing.assert_array_equal(data["logits"], first[-1].numpy())
        np.testing.assert_array_equal(data["h"], second[-1].numpy())
