"""The dump format's names and rules, spelled once.

Every other place that needs them (the Python writer and reader, the capture runtime, the C++
flush in kernels/dump.cpp) takes them from here or is checked against here by a test
(tests/format/test_spec.py). docs/format.md is the description for people.
"""

from __future__ import annotations

import re

FORMAT_NAME = "compiledump-dump"  # the manifest's "format"
FORMAT_VERSION = 1  # the manifest's "format_version"; a reader reads newer versions with a note
REPORT_FORMAT = "compiledump-compare"  # the JSON report of `compiledump compare`
REPORT_FORMAT_VERSION = 1  # its "format_version"

# The capture kinds as the manifest names them ("kind" of a key or tag).
KINDS = ("record", "record_once", "step", "ids")

# Why a capture was not kept, as the manifest's "drops" names them.
DROP_REASONS = (
    "suspended",  # inside profiling()
    "token_gate",  # shape[0] != COMPILEDUMP_TOKENS
    "rows_gate",  # set_rows() value above COMPILEDUMP_MAX_ROWS
    "row_out_of_range",  # the gather row does not exist in that batch
    "shape_changed",  # payload shape differs from the tag's first capture
    "arena_full",  # no arena space left when the tag was first seen
    "tag_table_full",  # more tags than COMPILEDUMP_MAX_TAGS
    "step_capacity",  # more steps than COMPILEDUMP_MAX_STEPS
    "layer_steps",  # a layer's step state (`layer<N>_step`) past COMPILEDUMP_LAYER_STEPS steps
    "interrupted",  # the process died while writing it (a recovered dump; the torn value is not read)
)
# Reported in the manifest but not warned about: the user asked for these filters.
DELIBERATE_REASONS = frozenset({"suspended", "token_gate", "rows_gate", "layer_steps"})

# The manifest's `mixers` ({layer index: kind}, written by instrument()): softmax attention, a layer
# without token mixing, or else the name of a linear-attention / state-space mixer.
MIXER_ATTENTION = "attention"
MIXER_NONE = "mlp"
NOT_RECURRENT_MIXERS = (MIXER_ATTENTION, MIXER_NONE)

# File names: `<stem>.npz` + `<stem>.json`, stem `compiledump_rank<R>_pid<P>`. debug_dump.py
# wrote `deepinfer_layers_rank<R>_pid<P>.npz` without a manifest; readers accept both.
STEM_PREFIX = "compiledump"
LEGACY_STEM_PREFIX = "deepinfer_layers"
DUMP_GLOBS = (f"{STEM_PREFIX}_rank*_pid*.npz", f"{LEGACY_STEM_PREFIX}_rank*_pid*.npz")
DUMP_NAME = re.compile(
    rf"^(?:{STEM_PREFIX}|{LEGACY_STEM_PREFIX})_rank(?P<rank>.+?)_pid(?P<pid>\d+)(?:_(?P<copy>\d+))?\.npz$")


# Crash-proof capture (capture/persist.py writes, capture/journal.py and recover.py read): a running process's
# arena, control block and journal in `<stem>.live/` next to its dump; gone after a normal exit.
LIVE_SUFFIX = ".live"
# `.<stem>.claim`: an empty hidden file reserving a dump's name while its process runs (capture/flush.py).
CLAIM_SUFFIX = ".claim"
LIVE_ARENA = "arena.f32"
LIVE_CTRL = "ctrl.i32"
LIVE_JOURNAL = "journal.jsonl"
LIVE_FAULT = "fault.txt"
JOURNAL_VERSION = 1


def dump_stem(rank: str, pid: int, copy: int = 1) -> str:
    """The file stem of one process's dump; `copy` > 1 for a later process of the same rank and pid
    writing into the same directory (a restarted container's, or a replica in another pid
    namespace): `<stem>_<copy>`, so that it never overwrites the earlier one's files."""
    stem = f"{STEM_PREFIX}_rank{rank}_pid{pid}"
    return stem if copy == 1 else f"{stem}_{copy}"


# `record_step(tag)` writes keys `<tag>_<n>`, n = 0, 1, 2, ... without leading zeros.
_STEP_KEY = re.compile(r"^(?P<prefix>.+)_(?P<step>0|[1-9][0-9]*)$")


def step_key(tag: str, step: int) -> str:
    """The key of decode step `step` of a `record_step` tag."""
    return f"{tag}_{step}"


# The manifest's `tags` holds one entry per tag, a `record_step` tag's named `<tag>_<n>`.
STEP_TAG_SUFFIX = "_<n>"


def tag_entry_name(tag: str, step: bool) -> str:
    """The name of `tag`'s entry in the manifest's `tags` (`step`: a `record_step` tag)."""
    return tag + STEP_TAG_SUFFIX if step else tag


def split_step_key(key: str) -> tuple[str, int] | None:
    """(tag, step) if `key` has the shape of a step key `<tag>_<n>`, else None."""
    match = _STEP_KEY.match(key)
    return (match.group("prefix"), int(match.group("step"))) if match else None


def masked_scores(tag: str) -> bool:
    """Whether `tag` holds a sparse-attention indexer's scores (`layer<N>_index_router` and its steps,
    as `instrument` records them), where -inf marks a masked key by design:
    counted as non-finite, but never the dump's first non-finite value."""
    return tag.endswith(("_index_router", "_index_step_router"))


# Tags `layer<N>` and `layer<N>_<x>` belong to layer N: the comparator orders by it and the MoE
# layer filter (COMPILEDUMP_MOE_LAYERS) reads it.
_LAYER_TAG = re.compile(r"^layer(\d+)(?:_|$)")
LAYER_ONLY = re.compile(r"^layer\d+$")


# `instrument` records each decoder layer's output twice: the prompt's rows as `layer<N>`, and the
# token whose logits each forward's `logits_<n>` holds as the step tag `layer<N>_step` (a layer's
# step state), of the first COMPILEDUMP_LAYER_STEPS forwards. Its step 0 comes from the prompt's
# forward, where it repeats `layer<N>`'s last row on a `[batch, seq, hidden]` model but holds the
# step row (the first token) of a flat `[tokens, hidden]` engine's prefill: the comparator leaves
# it out.
# The stream after its attention and its MLP's (or a Mamba layer's mixer's) own output are kept
# likewise, `layer<N>_attn_step`, `layer<N>_mlp_step` (`layer<N>_mixer_step`): a decode step is
# judged at the points a prompt is, so that a decode-only bug is named at its sublayer.
_STREAM_STEP_TAG = re.compile(r"^layer\d+(?:_attn|_mlp|_shared_mlp|_mixer)?_step$")


def stream_step_tag(tag: str) -> bool:
    """Whether `tag` is a layer's step state, `layer<N>_step`, or the state after its attention or
    its MLP's or mixer's output, `layer<N>_attn_step`, `layer<N>_mlp_step`, `layer<N>_mixer_step`
    (COMPILEDUMP_LAYER_STEPS steps kept)."""
    return _STREAM_STEP_TAG.match(tag) is not None


_SUBLAYER_STEP_TAG = re.compile(r"^layer\d+_(?:attn|mlp|shared_mlp|mixer)_step$")


def sublayer_step_tag(tag: str) -> bool:
    """Whether `tag` is a sublayer's step state, `layer<N>_attn_step`, `_mlp_step`, `_mixer_step`
    (`_shared_mlp_step`: Granite's dense MLP beside its MoE block, or a shared expert inside it)."""
    return _SUBLAYER_STEP_TAG.match(tag) is not None


_SHARED_MLP_TAG = re.compile(r"^layer\d+_shared_mlp(?:_step)?$")


def shared_mlp_tag(tag: str) -> bool:
    """Whether `tag` is Granite's dense MLP beside an MoE block or a shared expert inside one,
    `layer<N>_shared_mlp` (or its steps'), which `instrument` records since 2026-12-06."""
    return _SHARED_MLP_TAG.match(tag) is not None


_MIXER_TAG = re.compile(r"^layer\d+_mixer(?:_step)?$")


def mixer_tag(tag: str) -> bool:
    """Whether `tag` is a token mixer's own output, `layer<N>_mixer` (or its steps'), which
    `instrument` records of softmax attention beside an MLP since 2026-12-06 (the thirtieth
    session; of a layer without an MLP before)."""
    return _MIXER_TAG.match(tag) is not None


def stream_step_key(key: str) -> bool:
    """Whether `key` is a step of a layer's step state, `layer<N>_step_<n>` (or of a sublayer's,
    `layer<N>_mlp_step_<n>`, ...)."""
    split = split_step_key(key)
    return split is not None and stream_step_tag(split[0])


def prompt_stream_step(key: str) -> bool:
    """Whether `key` is a layer's step state at step 0 (`layer<N>_step_0`), which is not compared."""
    return stream_step_key(key) and key.endswith("_0")


# `instrument` records the request row of the 2-D attention mask a Hugging Face model is given
# (a batch `generate` padded) as the ids `prompt_mask` of the prompt's call: the comparator keeps
# the prompt's real positions (compare/padding.py) and does not compare the mask itself.
PROMPT_MASK_TAG = "prompt_mask"
# `instrument` records every prompt row of a vision-language model's first decoder layer's input as
# `input_embeds`; its region is capped at an eighth of the arena (capture/arena.py), so that a long
# multimodal prompt's rows cannot crowd the layers' tags out (over it: counted as arena_full).
INPUT_EMBEDS_TAG = "input_embeds"
# `instrument` records the first source row of an encoder-decoder's encoder output (which the
# request's decoder cross-attends to; recorded once: the encoder runs once per request, on a
# source whose length is not the decoder prompt's) as `encoder_output`.
ENCODER_OUTPUT_TAG = "encoder_output"


def layer_of(tag: str) -> int | None:
    """Layer number of a tag `layer<N>` or `layer<N>_<x>`, else None."""
    match = _LAYER_TAG.match(tag)
    return int(match.group(1)) if match else None


# `instrument(exclude=...)` leaves default tags out by pattern, `{i}` standing for any layer index
# (the manifest's "exclude" lists the patterns). A tag left out takes along the tags recorded by
# the same hook: a layer `layer<N>` its step state `layer<N>_step` (`layer<N>_mlp` its
# `layer<N>_mlp_step`, ...), a router `<name>_router` its
# picks `<name>_topk` and its steps `<name>_step_router`, `<name>_step_topk` (instrument's routers:
# a layer's MoE `layer<N>`, its attention heads' `layer<N>_attn`, its indexer's `layer<N>_index`).
ROUTING_SUFFIXES = ("_step_topk", "_step_router", "_topk")  # a router's tags beside `<name>_router`
_INSTRUMENT_ROUTING = re.compile(rf"^(layer\d+(?:_attn|_index)?)(?:{'|'.join(ROUTING_SUFFIXES)})$")


def tag_pattern(pattern: str) -> re.Pattern:
    """The regex of an `exclude` pattern: the pattern literally, `{i}` matching any layer index."""
    return re.compile(re.escape(pattern).replace(re.escape("{i}"), r"\d+"))


def excluded_by(tag: str, patterns) -> str | None:
    """The first of `patterns` (`instrument(exclude=...)`'s) that leaves `tag` out, itself or with
    the tag it is recorded with; None if none does."""
    owners = [tag]
    if stream_step_tag(tag):
        owners.append(tag[: -len("_step")])
    if (routing := _INSTRUMENT_ROUTING.match(tag)) is not None:
        owners.append(f"{routing.group(1)}_router")
    return next((pattern for pattern in patterns if any(tag_pattern(pattern).fullmatch(o) for o in owners)), None)


# A `record_step` of an integer tensor (expert ids of each decode step) is stored as float32 like
# every step (exact below 2**24); its manifest `source_dtype` names the integer dtype, and readers
# give it back as int32 ids.
_INTEGER_SOURCE = re.compile(r"^(?:u?int(?:8|16|32|64)|bool)$")


def is_integer_source(source_dtype: str | None) -> bool:
    """Whether a manifest `source_dtype` (``int64``, ``bfloat16``, ...) names an integer dtype."""
    return bool(source_dtype and _INTEGER_SOURCE.match(source_dtype))
