"""The format's names and rules (compiledump/format/spec.py) and their C++ copies."""

import re
from pathlib import Path

import pytest

from compiledump.format import spec
from compiledump.ops import layout as L

KERNELS = Path(__file__).resolve().parents[2] / "kernels"


def test_cpp_format_constants_match_python():
    text = (KERNELS / "format.h").read_text()
    assert re.search(r'kFormatName = "([^"]+)"', text).group(1) == spec.FORMAT_NAME
    assert int(re.search(r"kFormatVersion = (\d+)", text).group(1)) == spec.FORMAT_VERSION
    assert re.search(r'kStemPrefix = "([^"]+)"', text).group(1) == spec.STEM_PREFIX
    assert re.search(r'kLiveSuffix = "([^"]+)"', text).group(1) == spec.LIVE_SUFFIX
    assert re.search(r'kClaimSuffix = "([^"]+)"', text).group(1) == spec.CLAIM_SUFFIX


def test_cpp_drop_reasons_and_kinds_match_python():
    dump = (KERNELS / "dump.cpp").read_text()
    pairs = re.findall(r'\{(CNT_\w+), "(\w+)"\}', dump)
    assert {getattr(L, counter): name for counter, name in pairs} == L.DROP_REASONS
    kinds = dict(re.findall(r'case (KIND_\w+): return "(\w+)";', dump))
    assert {getattr(L, kind): name for kind, name in kinds.items()} == L.KIND_NAMES
    assert 'std::string past_capacity = "step_capacity";' in (KERNELS / "compiledump.h").read_text()
    assert f'slot->kind == KIND_STEP ? slot->tag + "{spec.STEP_TAG_SUFFIX}" : slot->tag' in dump  # tag_entry_name


def test_device_names_are_the_format_names():
    # Counters map onto the manifest's drop reasons, kinds onto its kinds: nothing else.
    # Three reasons are no counter: steps past the region (past COMPILEDUMP_MAX_STEPS, or a layer's
    # step state past COMPILEDUMP_LAYER_STEPS), and writes a crash left uncommitted.
    assert set(L.DROP_REASONS.values()) | {"step_capacity", "layer_steps", "interrupted"} == set(spec.DROP_REASONS)
    assert set(L.KIND_NAMES.values()) == set(spec.KINDS)
    assert spec.DELIBERATE_REASONS < set(spec.DROP_REASONS)


@pytest.mark.parametrize("key, parts", [
    ("logits_0", ("logits", 0)), ("logits_17", ("logits", 17)), ("layer3_moe_out_2", ("layer3_moe_out", 2)),
    ("a_b_10", ("a_b", 10)), ("x_03", None), ("x_", None), ("_3", None), ("x3", None), ("x_-1", None), ("x_1a", None),
])
def test_step_keys(key, parts):
    assert spec.split_step_key(key) == parts
    if parts is not None:
        assert spec.step_key(*parts) == key


@pytest.mark.parametrize("tag, layer", [
    ("layer0", 0), ("layer12_moe_out", 12), ("layer03_x", 3), ("layer", None), ("layer_3", None),
    ("layer3a_x", None), ("xlayer3", None), ("logits", None), ("layer7_", 7),
])
def test_layer_of(tag, layer):
    assert spec.layer_of(tag) == layer


PATTERNS = ["layer{i}_mlp", "layer1", "layer{i}_router", "layer{i}_index_router", "a.b", "x{i}"]


@pytest.mark.parametrize("tag, pattern", [
    ("layer0_mlp", "layer{i}_mlp"), ("layer12_mlp", "layer{i}_mlp"), ("layer_mlp", None), ("layer1_mlp_x", None),
    ("layer1", "layer1"), ("layer1_step", "layer1"), ("layer11", None), ("layer11_step", None), ("layer1_attn", None),
    ("layer3_router", "layer{i}_router"), ("layer3_topk", "layer{i}_router"), ("layer3_step_router", "layer{i}_router"),
    ("layer3_step_topk", "layer{i}_router"), ("layer3_attn_topk", None), ("layer3_index_step_topk", "layer{i}_index_router"),
    ("layer3_index_topk", "layer{i}_index_router"), ("layer3_index_router", "layer{i}_index_router"),
    ("foo_topk", None), ("a.b", "a.b"), ("axb", None), ("x7", "x{i}"), ("x", None), ("logits", None),
])
def test_excluded_by_names_the_pattern_that_leaves_a_tag_out(tag, pattern):
    """A pattern leaves out its tags and what their hooks record along (a layer's step state, a
    router's picks and steps); `{i}` is any layer index, everything else literal."""
    assert spec.excluded_by(tag, PATTERNS) == pattern
    assert spec.excluded_by(tag, []) is None


def test_dump_names():
    for rank in ("0", "13", "x"):
        match = spec.DUMP_NAME.match(spec.dump_stem(rank, 4242) + ".npz")
        assert match and match.group("rank") == rank and match.group("pid") == "4242"
    assert spec.DUMP_NAME.match("deepinfer_layers_rank1_pid7.npz").group("rank") == "1"
    assert spec.DUMP_NAME.match("compiledump_rank1_pid7.json") is None
    assert spec.DUMP_NAME.match("other_rank1_pid7.npz") is None
