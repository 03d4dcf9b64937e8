"""Measuring one key of a REF/RUN pair into a :class:`KeyRecord`: the checks that decide whether
it can be compared, its metrics, and whether it diverges. A side merged from several ranks is
measured by :mod:`.merged_ranks` (each rank's share too, so the worst rank can be named)."""

from __future__ import annotations

import functools
import zipfile
from dataclasses import replace

import numpy as np

from ..format import spec
from ..format.keys import KeyInfo, index_ids_key_for, router_key_for, step_ids_key_for
from ..format.reader import Dump, Member
from ..format.routers import RouterInfo
from .cut import add_cut_rows
from .facts import SideFacts
from .key_record import KeyRecord
from .merged_ranks import measure_merged
from .metrics import RowMetrics, Workspace, compare_float_arrays, compare_id_arrays, compare_rows
from .options import DECODE_NO_FLIP, PRECISION_ORDER, CompareOptions, Thresholds, judged_class, pair_class
from .phases import not_comparable_reason
from .report import Problem
from .routing import judge_routing, top_k_counterexample
from .step_scale import StepScales


def logits_tags(infos: list[KeyInfo], members: dict[str, Member]) -> set[str]:
    """Step tags analysed for margins: those whose name contains ``logits`` if any, else every
    step tag whose arrays are 1-D floats."""
    step_infos = [info for info in infos if info.kind == "step"]
    named = {info.tag for info in step_infos if "logits" in info.tag}
    if named:
        return named
    return {info.tag for info in step_infos
            if info.key in members and len(members[info.key].shape) == 1 and not members[info.key].is_integer}


def float_class(ref: Dump, run: Dump, keys) -> str:
    """The precision class of a pair as its float keys ``keys`` say: the lowest class among
    them (``legacy`` when no key has a known class below fp32 but some has none), ``fp32`` when
    all are fp32. Expert ids without router logits are judged by it."""
    classes = set()
    for key in keys:
        if ref.members[key].is_integer or run.members[key].is_integer:
            continue
        ref_info, run_info = ref.infos.get(key), run.infos.get(key)
        classes.add(pair_class(ref_info.source_dtype if ref_info else None, run_info.source_dtype if run_info else None))
    known = [klass for klass in classes if klass in PRECISION_ORDER and klass != "fp32"]
    if known:
        return min(known, key=PRECISION_ORDER.index)
    if "legacy" in classes or not classes:
        return "legacy"
    return "fp32"


def _whole(dump: Dump, key: str) -> np.ndarray:
    """The one copy of ``key`` on ``dump``, read whole (ValueError when it has several replicas;
    OSError and the zip errors when it cannot be read)."""
    (copy,) = dump.replicas(key)
    return np.asarray(copy.whole())


class KeyMeasurer:
    """Measures the keys of one pair; holds what every key shares (settings, buffers)."""

    def __init__(self, ref: Dump, run: Dump, options: CompareOptions, rank: str, logits: set[str],
                 workspace: Workspace, klass: str = "legacy") -> None:
        self.ref, self.run = ref, run
        self.options = options
        self.rank = rank
        self.logits = logits
        self.workspace = workspace
        self.klass = klass  # the pair's class from its float keys (float_class)
        # The layers whose `layer<i>_mlp` is an MoE block's output, by either side's manifest
        routings = [(dump.manifest or {}).get("routing") or {} for dump in (ref, run)]
        self.moe_outputs = {i for routing in routings for i in routing.get("moe_outputs") or () if isinstance(i, int)}
        self.step_scales = StepScales(ref, options.chunk_elements)  # a decode step's row at its prompt's scale

    def record(self, info: KeyInfo, problems: list[Problem], not_comparable: str | None = None,
               no_flip: bool = False) -> KeyRecord:
        """Compare ``info.key`` (present on both sides); problems met go to ``problems``.
        ``not_comparable``: why the two values cannot be compared, found beyond the key itself
        (the sides fed this decode step different tokens). ``no_flip``: no routing flip can have
        reached this key (a decode step is then judged at the prefill thresholds)."""
        key = info.key
        ref_member, run_member = self.ref.members[key], self.run.members[key]
        ref_info, run_info = self.ref.infos.get(key, info), self.run.infos.get(key, info)
        sides = SideFacts(ref_info.source_dtype, run_info.source_dtype, ref_info.tokens, run_info.tokens,
                          ref_info.written_phase, run_info.written_phase)
        record = KeyRecord(key=key, rank=self.rank, kind=info.kind, tag=info.tag, layer=info.layer, step=info.step,
                           phase=info.phase, shape_ref=list(ref_member.shape), shape_run=list(run_member.shape),
                           dtype_ref=str(ref_member.read_dtype), dtype_run=str(run_member.read_dtype), sides=sides,
                           limits=self.options.thresholds_for(
                               key, ref_info.source_dtype, run_info.source_dtype,
                               DECODE_NO_FLIP if no_flip and info.kind == "step" else info.phase, self.klass,
                               moe_output=info.tag == f"layer{info.layer}_mlp_step" and info.layer in self.moe_outputs))
        reason = not_comparable or not_comparable_reason(info.kind, ref_info, run_info)
        if reason is not None:
            # Values of different phases or token counts: comparing them could only mislead.
            return replace(record, status="not_comparable", reason=reason)
        all_rows = ref_info.all_rows or run_info.all_rows or info.all_rows
        info = replace(info, all_rows=all_rows)
        dtypes = f"{ref_member.read_dtype} vs {run_member.read_dtype}"
        if ref_member.is_integer != run_member.is_integer:
            problems.append(Problem("dtype_mismatch", self.rank, f"{dtypes}: integer ids vs floats, not compared", key))
            record.status = "skipped"
            return record
        if ref_member.read_dtype != run_member.read_dtype:
            how = "compared as integers" if ref_member.is_integer else "compared in float64"
            problems.append(Problem("dtype_mismatch", self.rank, f"{dtypes}: {how}", key))
        last_row_of = None  # "ref"/"run": the all-rows side, compared at its last row
        masked_keys = False  # an indexer's scores over caches of two lengths: compared over the keys both have
        if ref_member.shape != run_member.shape:
            shapes = f"{list(ref_member.shape)} vs {list(run_member.shape)}"
            if self.ref.merged_ranks is None and self.run.merged_ranks is None:
                last_row_of = _all_rows_side(ref_member.shape, ref_info, run_member.shape, run_info)
            if last_row_of is not None:
                # A one-row key holds the prompt's last row (record's default): an older dump,
                # or instrument(router_rows="one"), against one that kept every row.
                how = "one row against all rows, compared at the last row (the row a one-row record keeps)"
                info = replace(info, all_rows=False)
            elif _squeezed(ref_member.shape) == _squeezed(run_member.shape):
                how = "differ only by size-1 dimensions, compared flattened"
            elif spec.masked_scores(info.tag) and ref_member.shape[:-1] == run_member.shape[:-1]:
                masked_keys = True  # a dynamic cache against a static one: the longer row's extra keys must be masked
            else:
                problems.append(Problem("shape_mismatch", self.rank, f"{shapes}: not compared", key))
                record.status = "skipped"
                return record
            if not masked_keys:  # keys over two cache lengths: expected, no problem
                problems.append(Problem("shape_mismatch", self.rank, f"{shapes}: {how}", key))
        try:
            if self.ref.merged_ranks is None and self.run.merged_ranks is None:
                (ref_copy,), (run_copy,) = self.ref.replicas(key), self.run.replicas(key)
                x, y = ref_copy.whole(), run_copy.whole()
                if masked_keys:
                    if (trimmed := keys_both_have(x, y)) is None:
                        problems.append(Problem("shape_mismatch", self.rank, f"{list(x.shape)} vs {list(y.shape)}: "
                                                "not compared (the longer side's further keys are not all masked)", key))
                        record.status = "skipped"
                        return record
                    x, y = trimmed
                if last_row_of is not None:
                    x, y = (x[-1], y) if last_row_of == "ref" else (x, y[-1])
                result = self.measure(record, x, y, info)
                if result.ids is not None and (not result.ids.ids_equal or self._weighs_by_cut(info)):
                    result = self.judge_ids(result, info, x, y)
                elif result.floats is not None and result.metric != "nonfinite" and self._judges_ids(info) \
                        and not (info.kind == "step" and (record.limits.klass == "fp32" or no_flip)):
                    # A decode step's router logits: one logit per expert, in the decode-step noise
                    # and reached by flips of earlier tokens; what moves them moves the step's later
                    # keys too. A sparse-attention indexer's scores are noisier than
                    # the hidden states (ReLU'd sums over heads; fp8 in engines), and what its picks
                    # change shows in layer<i>_attn. A non-finite mismatch is never excused. In
                    # fp32 (routing does not flip, decode noise ~1e-12) and at a step no routing
                    # flip can have reached (no_flip), a step's router logits are judged: they name
                    # the first layer a decode-only bug reaches.
                    result = replace(result, status="shown", divergent=False, metric=None, value=None)
                return result
            # A merged side's ids are judged strictly (any mismatch diverges): no routing analysis.
            return measure_merged(self.measure, self.ref, self.run, record, info)
        except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
            problems.append(Problem("unreadable", self.rank, f"could not read the arrays: {exc}", key))
            record.status = "skipped"
            return record

    def not_compared(self, info: KeyInfo) -> KeyRecord:
        """The record of a key both sides hold that one of them cannot give (its problem says
        why): skipped, with the shapes of the sides that can ([] for the other)."""
        ref_member, run_member = self.ref.members.get(info.key), self.run.members.get(info.key)
        shape = lambda member: list(member.shape) if member is not None else []  # noqa: E731
        dtype = lambda member: str(member.read_dtype) if member is not None else "-"  # noqa: E731
        ref_info, run_info = self.ref.infos.get(info.key, info), self.run.infos.get(info.key, info)
        sides = SideFacts(ref_info.source_dtype, run_info.source_dtype, ref_info.tokens, run_info.tokens,
                          ref_info.written_phase, run_info.written_phase)
        return KeyRecord(key=info.key, rank=self.rank, kind=info.kind, tag=info.tag, layer=info.layer, step=info.step,
                         phase=info.phase, shape_ref=shape(ref_member), shape_run=shape(run_member),
                         dtype_ref=dtype(ref_member), dtype_run=dtype(run_member), status="skipped", sides=sides)

    def measure(self, record: KeyRecord, x: np.ndarray, y: np.ndarray, info: KeyInfo,
                margins: bool = True) -> KeyRecord:
        """``record`` with the metrics of REF array ``x`` against RUN array ``y`` and, when the
        key diverges, ``status``/``divergent`` and (floats) the ``metric`` and ``value`` that crossed."""
        if np.issubdtype(x.dtype, np.integer) or x.dtype == np.bool_:
            if x.shape != y.shape:
                x, y = x.reshape(-1), y.reshape(-1)
            ids = compare_id_arrays(x, y)
            return replace(record, ids=ids, status="ok" if ids.ids_equal else "mismatch", divergent=not ids.ids_equal)
        # Decode logits drive the argmax-flip analysis; the prefill logits (a 1-D `logits`
        # record) get the same margin columns for reading, but no flip classification.
        step_logits = margins and info.kind == "step" and info.tag in self.logits
        prefill_logits = margins and info.kind != "step" and "logits" in info.tag and x.ndim == 1
        want_margins = step_logits or prefill_logits
        limits = record.limits or self.options.thresholds_for(info.key)
        floats = compare_float_arrays(x, y, margins=want_margins, chunk=self.options.chunk_elements,
                                      workspace=self.workspace)
        rows = None
        if info.all_rows and x.ndim == 2 and x.shape == y.shape:
            rows = compare_rows(x, y, chunk=self.options.chunk_elements)
            self.step_scales.remember(info, rows.scale, x.shape[-1])
        if info.kind == "step" and rows is None and floats.nonfinite_mismatch == 0:
            floats, scale_from = self.step_scales.floored(floats, x, y, info.tag)
            record = replace(record, scale_from=scale_from)
        record = replace(record, threshold=limits.rel_diff, limits=limits, floats=floats, rows=rows,
                         logits=want_margins, margin_analysis=step_logits)
        if floats.nonfinite_mismatch > 0:
            record = replace(record, status="divergent", divergent=True, metric="nonfinite",
                             value=floats.nonfinite_mismatch)
        elif rows is not None:
            record = judge_rows(record, rows, limits)
        else:
            _, metric = limits.ratio(floats.rel_diff, floats.norm_diff)
            if floats.rel_diff > limits.rel_diff or (floats.norm_diff or 0.0) > limits.norm_diff:
                value = floats.rel_diff if metric == "rel_diff" else floats.norm_diff
                record = replace(record, status="divergent", divergent=True, metric=metric, value=value)
        if floats.margins is not None and floats.margins.ref.argmax is not None:
            record = replace(record, argmax_equal=floats.margins.ref.argmax == floats.margins.run.argmax,
                             near_tie_epsilon=self.options.near_tie_epsilon(floats.margins.ref.top1))
        return record

    def _weighs_by_cut(self, info: KeyInfo) -> bool:
        """Whether ``info``'s ids come from a router declared with a sparsemixer ``cut`` (PhiMoE's),
        whose weights can differ with the ids equal (compare/cut.py)."""
        selection = self.selection(router_key_for(info.key, step=info.kind == "step"))
        return selection is not None and selection.cut is not None

    def _judges_ids(self, info: KeyInfo) -> bool:
        """Whether ``info`` is a decode step's router logits beside that step's ids, or a sparse-
        attention indexer's scores (``layer<i>_index_router``) beside its picks, compared on both
        sides (the same shape, integers on both): such scores are read to judge the ids and shown,
        not judged themselves (docs/compare.md, "Decode steps", "Sparse-attention indexers")."""
        ids_key = step_ids_key_for(info.key) if info.kind == "step" else index_ids_key_for(info.key)
        if ids_key is None or ids_key not in self.ref.members or ids_key not in self.run.members:
            return False
        ref_ids, run_ids = self.ref.members[ids_key], self.run.members[ids_key]
        ids_info = self.ref.infos.get(ids_key)
        return (ids_info is not None and (ids_info.kind == "step") == (info.kind == "step")
                and ref_ids.is_integer and run_ids.is_integer
                and ref_ids.shape == run_ids.shape)

    @functools.cached_property
    def not_top_k(self) -> str | None:
        """A reference row, of any ids key beside router logits, whose ids are not the top-k of
        those logits, or not what the router's declared selection picks (``layer2_topk row 3``),
        or None. Routing is one function of the whole model, so one such row anywhere means logit
        gaps judge no row of any layer (read once per pair)."""
        for key in sorted(self.ref.members):
            info = self.ref.infos.get(key)
            router_key = router_key_for(key, step=info is not None and info.kind == "step")
            if not self.ref.members[key].is_integer or router_key not in self.ref.members \
                    or self.ref.members[router_key].is_integer:
                continue
            try:
                ids, router = _whole(self.ref, key), _whole(self.ref, router_key)
            except (OSError, ValueError, zipfile.BadZipFile, EOFError):
                continue  # unreadable or several replicas: judge_ids says so for its own key
            router_info = self.ref.infos.get(router_key)
            row = top_k_counterexample(ids, router, bool(router_info and router_info.all_rows),
                                       self.selection(router_key))
            if row is not None:
                return f"{key} row {row}"
        return None

    def selection(self, router_key: str | None) -> RouterInfo | None:
        """How the router of ``router_key`` selects experts, as REF declares it, else as RUN does
        (``compiledump.declare_router``); None: plain top-k."""
        if router_key is None:
            return None
        return self.ref.router(router_key) or self.run.router(router_key)

    def _run_router(self, router_key: str) -> np.ndarray | None:
        """RUN's router logits beside the ids (for the run's router noise), when it has one float
        copy of them; None otherwise (the epsilon then stays the ulps rule)."""
        member = self.run.members.get(router_key)
        if member is None or member.is_integer:
            return None
        try:
            return _whole(self.run, router_key)
        except (OSError, ValueError, zipfile.BadZipFile, EOFError):
            return None

    def judge_ids(self, record: KeyRecord, info: KeyInfo, x: np.ndarray, y: np.ndarray) -> KeyRecord:
        """``record`` (ids that differ, or a sparsemixer router's: compare/cut.py) judged by the
        routing rule (compare/routing.py): the reference's router logits of the same layer decide
        near tie or divergence; ``record`` itself when nothing differs. The class
        comes from the router key's source dtypes (a float32 router takes the pair's class: the
        float32 router of a bfloat16 model flips as bfloat16 does), else from the pair's float keys."""
        router_key = router_key_for(info.key, step=info.kind == "step")
        router = unavailable = None
        klass, class_from = self.klass, "pair"
        if router_key is not None and router_key in self.ref.members and not self.ref.members[router_key].is_integer:
            router_info, ids_info = self.ref.infos.get(router_key), self.ref.infos.get(info.key)
            if router_key in self.run.members and not self.run.members[router_key].is_integer:
                run_info = self.run.infos.get(router_key)
                klass = judged_class(pair_class(router_info.source_dtype if router_info else None,
                                                run_info.source_dtype if run_info else None), self.klass)
                class_from = "router"
            tokens = (router_info.tokens if router_info else None, ids_info.tokens if ids_info else None)
            if None not in tokens and tokens[0] != tokens[1]:
                unavailable = (f"REF {router_key} holds a call of {tokens[0]} tokens, the ids one of "
                               f"{tokens[1]}")
            else:
                try:
                    router = _whole(self.ref, router_key)
                except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
                    unavailable = f"REF {router_key} could not be read: {exc}"
        all_rows = bool(router_key and router_key in self.ref.infos and self.ref.infos[router_key].all_rows)
        run_router = self._run_router(router_key) if router is not None else None
        if run_router is not None and spec.masked_scores(router_key) and run_router.shape != router.shape:
            # an indexer's scores over caches of two lengths: its noise over the keys both have
            router, run_router = keys_both_have(router, run_router) or (router, None)
        selection = self.selection(router_key)
        routing = judge_routing(x, y, router, router_key, all_rows, klass, class_from, self.options.near_tie,
                                self.options.near_tie_ulps, unavailable, self.not_top_k, run_router, selection)
        if selection is not None and selection.cut is not None and router is not None and run_router is not None:
            add_cut_rows(routing, x, y, router, run_router, all_rows, selection.cut, self.options.near_tie,
                         self.options.near_tie_ulps)
        if not routing.rows:
            return record  # the ids agree, and so does every pick's sparsemixer cut
        status = "mismatch" if routing.divergent else routing.verdict
        return replace(record, routing=routing, status=status, divergent=routing.divergent)


def judge_rows(record: KeyRecord, rows: RowMetrics, limits: Thresholds, skip=frozenset()) -> KeyRecord:
    """An all-rows key diverges when any token row (but those in ``skip``) crosses a threshold;
    it names those rows and the metric with the largest value/threshold among them."""
    bad = [index for index, (rel, norm) in enumerate(zip(rows.rel_diff, rows.norm_diff))
           if index not in skip and (rel > limits.rel_diff or (norm or 0.0) > limits.norm_diff)]
    if not bad:
        return replace(record, status="ok", divergent=False, metric=None, value=None, divergent_rows=[])
    worst = max(bad, key=lambda index: limits.ratio(rows.rel_diff[index], rows.norm_diff[index])[0])
    _, metric = limits.ratio(rows.rel_diff[worst], rows.norm_diff[worst])
    values = rows.rel_diff if metric == "rel_diff" else rows.norm_diff
    value = max((values[index] or 0.0) for index in range(len(values)) if index not in skip)
    return replace(record, status="divergent", divergent=True, metric=metric, value=value, divergent_rows=bad)


def _all_rows_side(ref_shape: tuple[int, ...], ref_info: KeyInfo, run_shape: tuple[int, ...],
                   run_info: KeyInfo) -> str | None:
    """"ref" or "run" when that side is an all-rows key `[tokens, dim]` and the other a one-row
    key `[dim]` of the same width; None otherwise."""
    for side, (mine, info), theirs in (("ref", (ref_shape, ref_info), run_shape), ("run", (run_shape, run_info), ref_shape)):
        if info.all_rows and len(mine) == 2 and len(theirs) == 1 and mine[1] == theirs[0]:
            return side
    return None


def _squeezed(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(n for n in shape if n != 1)


def keys_both_have(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """An indexer's scores over two numbers of keys (a dynamic cache against a static
    one), cut to the keys both have; None unless the shapes differ in the last dimension only and
    the wider side's further keys are all masked (-inf): absent keys, for the selection."""
    if x.shape[:-1] != y.shape[:-1]:
        return None
    width = min(x.shape[-1], y.shape[-1])
    extra = x[..., width:] if x.shape[-1] > width else y[..., width:]
    return (x[..., :width], y[..., :width]) if np.all(np.isneginf(extra)) else None
