"""Layout of the device control block, shared by the kernels and the host reader.

The control block is one flat int32 tensor: a small header of registers the host sets outside
any graph (and the kernels read at run time), then one fixed-size record of counters per tag
slot. Keeping the layout in one module means the Triton kernel, the CPU implementation and
`flush()` cannot disagree about which word means what.
"""

from __future__ import annotations

# Header registers (word index into the control block).
REG_ENABLED = 0  # 1 while capturing, 0 inside profiling()
REG_ROWS = 1  # last value given to set_rows()
REG_MAX_ROWS = 2  # COMPILEDUMP_MAX_ROWS: record_step is skipped while rows > max_rows
REG_RECORD_ROW = 3  # row that record() gathers; negative counts from the end (-1 = last)
REG_STEP_ROW = 4  # row that record_step() gathers (0 = first real request)
# Decode steps begun: one more than the highest step index any record_step() capture has claimed
# (kernels raise it). Non-finite values of other kinds are dated by it (SLOT_BAD_STEP).
REG_STEPS = 5
REG_CHECK_ALL = 6  # COMPILEDUMP_NONFINITE=all: 1 counts non-finite values in the whole input
HEADER_WORDS = 8

# Per-slot counters (word offset inside a slot's record). Exactly one of them is incremented by
# each capture call that reaches the device, so their sum is the number of calls.
CNT_WRITTEN = 0  # calls that passed every gate (for steps: the step number handed out)
CNT_SUSPENDED = 1  # inside profiling()
CNT_TOKEN_GATE = 2  # shape[0] is not the prompt length (decided on the host from the shape)
CNT_ROWS_GATE = 3  # set_rows value above COMPILEDUMP_MAX_ROWS
CNT_ROW_OUT_OF_RANGE = 4  # the gather row does not exist in this batch
CNT_SHAPE_CHANGED = 5  # payload shape differs from the tag's first capture
CNT_ARENA_FULL = 6  # no arena space was left when the tag was first seen
CNT_TAG_TABLE_FULL = 7  # more tags than COMPILEDUMP_MAX_TAGS (all share slot 0)
SLOT_COUNTERS = 8  # words 0..7 of a slot are the counters above
# Written by the kernel with each kept capture of the record kinds: the token count T of the call
# whose value the dump holds (the manifest's "tokens"; 0 until one is kept, or when the kept
# tensor was stored whole and has no token count).
SLOT_KEPT_TOKENS = 8
# Kept writes completed. The counter above is claimed before the payload is written and this one
# bumped after it, so a region whose writes were claimed but not all committed was torn by a
# crash (recover drops it, counted as "interrupted"); steps keep the first SLOT_COMMITTED.
SLOT_COMMITTED = 9
# Non-finite (NaN/Inf) input elements the kernels saw: in what a kept capture reads, or with
# REG_CHECK_ALL in the whole input of every call outside profiling(). Saturates near NONFINITE_CAP.
SLOT_NONFINITE = 10
# The first call that saw one: 1 + its step (a step capture's own index, else REG_STEPS at the
# call; 0: none yet), and its token count (0 for a tensor stored whole), set once.
SLOT_BAD_STEP = 11
SLOT_BAD_TOKENS = 12
# The decision of a capture split into two launches (a wide step or keep-first record, see
# LAUNCH_* below): the claim launch publishes it here and the copy launch's programs all act on
# it. Bits 0-28: the call's SLOT_BAD_STEP date (for a written step, its index + 1); bit 29: it
# writes; bit 30: the whole input is checked for NaN/Inf. Not read by the host.
SLOT_CLAIM = 13
CLAIM_WRITES = 1 << 29
CLAIM_CHECK_ALL = 1 << 30
SLOT_WORDS = 14
# A fingerprint of the layout: the native library reports the one it was built for, and is not
# loaded when it differs (ops/native.py).
CONTROL_LAYOUT = HEADER_WORDS * 1000 + SLOT_WORDS
# Kernels add to SLOT_NONFINITE only while it is below this, at most this much at once: it ends
# in [NONFINITE_CAP, 2^31) once saturated, never past int32 (the manifest says "saturated").
NONFINITE_CAP = 1 << 30

# Drop reasons as the manifest names them (format/spec.py DROP_REASONS), by counter.
DROP_REASONS = {
    CNT_SUSPENDED: "suspended",
    CNT_TOKEN_GATE: "token_gate",
    CNT_ROWS_GATE: "rows_gate",
    CNT_ROW_OUT_OF_RANGE: "row_out_of_range",
    CNT_SHAPE_CHANGED: "shape_changed",
    CNT_ARENA_FULL: "arena_full",
    CNT_TAG_TABLE_FULL: "tag_table_full",
}

# Capture kinds (the `kind` argument of the capture op).
KIND_RECORD = 0  # last write wins, row from REG_RECORD_ROW, hc mean for 3-D input
KIND_RECORD_ONCE = 1  # first write wins, otherwise as KIND_RECORD
KIND_STEP = 2  # appended at the tag's next step index, row from REG_STEP_ROW, rows-gated
KIND_IDS = 3  # whole tensor, stored as int32, last write wins
KIND_RECORD_ROWS = 4  # as KIND_RECORD, but every row (`[tokens, dim]`, hc mean per row)
# As the manifest names them (format/spec.py KINDS); all-rows keys are "record" with "rows": "all".
KIND_NAMES = {KIND_RECORD: "record", KIND_RECORD_ONCE: "record_once", KIND_STEP: "step", KIND_IDS: "ids",
              KIND_RECORD_ROWS: "record"}
# The kinds whose kept captures set SLOT_KEPT_TOKENS.
RECORD_KINDS = (KIND_RECORD, KIND_RECORD_ONCE, KIND_RECORD_ROWS)

# Launches of the device kernels (the Triton kernel's `phase` argument, ops/variants.py
# `launches_for`; the native CUDA kernel's, kernels/capture_device.h `launches_for`). Whether and
# where a step or keep-first record writes depends on the counter value its claim returns, and
# programs of one launch cannot wait for each other, so such a capture runs one program, or, when
# its row is wide, two launches: one program claims and publishes the decision (SLOT_CLAIM), then
# many copy the row as it says. Stream order puts the copy after the claim, in a CUDA graph too.
LAUNCH_WHOLE = 0  # claim and copy in one launch
LAUNCH_CLAIM = 1  # one program: the claim, the decision published; copies nothing
LAUNCH_COPY = 2  # the published decision's copy, its NaN/Inf count and commit; claims nothing
# A step or keep-first record is split (`splits`) when its row reads SPLIT_MIN_READ elements or more
# (H x D: an hc mean or an hc copy reads every hc row) over SPLIT_MIN_COLUMNS columns or more (two
# of the Triton kernel's 2048-column tiles, so the copy launch has programs to spread over). One
# more kernel node against a row read by one program or block; on the first H200 run (gpu_bench
# `wide_step`, benchmarks/RESULTS.md, us per capture split vs one program): [64, 32000] fp32 5.0
# vs 9.8, [64, 129280] fp32 5.1 vs 34.3, [64, 4, 7168] bf16 (a step's 4 hc rows) 6.3 vs 9.0: split;
# [64, 7168] bf16 5.2 vs 4.7: one program. One rule for both device kernels (kernels/layout.h,
# capture_device.h), so their control blocks (SLOT_CLAIM included) agree word for word.
SPLIT_MIN_READ = 4 * 2048 + 1
SPLIT_MIN_COLUMNS = 2048 + 1


def splits(H: int, D: int) -> bool:
    """Whether a step or keep-first record of rows of H x D elements is a claim launch and a copy
    launch (read at call time: benchmarks/gpu_kernel_bench.py varies the two thresholds)."""
    return H * D >= SPLIT_MIN_READ and D >= SPLIT_MIN_COLUMNS


# Geometry modes: how the op views its input as [T, H, D] and which row it takes.
ROW_FIXED_ZERO = -1  # whole tensor viewed as one row
ROW_ALL = -2  # every row (KIND_RECORD_ROWS)
# otherwise the row comes from register REG_RECORD_ROW or REG_STEP_ROW


# Arena regions start on a multiple of this many words (16 bytes): the Triton kernel may then
# use vector stores for rows whose width is a multiple of 4 words.
REGION_ALIGN_WORDS = 4


def slot_base(slot: int) -> int:
    """Word index of slot `slot`'s first counter in the control block."""
    return HEADER_WORDS + slot * SLOT_WORDS


def kept_any(ctrl) -> bool:
    """Whether a control block (numpy or torch) counts any kept capture (`CNT_WRITTEN` of any
    slot): calls that gates or `profiling()` dropped are not captures."""
    return bool(ctrl[HEADER_WORDS + CNT_WRITTEN :: SLOT_WORDS].any())


def control_words(max_tags: int) -> int:
    """Size of a control block with `max_tags` slots (slot 0 is the shared overflow slot)."""
    return HEADER_WORDS + (max_tags + 1) * SLOT_WORDS


def without_claims(ctrl):
    """A copy of the control block tensor `ctrl` with every slot's SLOT_CLAIM word zeroed: what
    kernels that never split a capture (the reference and the CPU kernels) hold, for comparing
    their control blocks with a device kernel's word for word."""
    out = ctrl.clone()
    out[HEADER_WORDS:].view(-1, SLOT_WORDS)[:, SLOT_CLAIM] = 0
    return out
