"""Compare two dumps and name the first divergent layer and decode step (``compiledump compare``).

numpy and the standard library only, so it runs on a machine without torch or a GPU. The parts:
reading files (``compiledump.format.reader``, ``.keys``), pairing the two sides (:mod:`.pairing`, merging
sharded ranks in :mod:`.shards`, renaming RUN keys with ``--map`` in :mod:`.rename`; :mod:`.view` is the base of the views of one side: renamed, unpadded, with derived ids), thresholds per
precision class (:mod:`.options`), which values can be compared at all and what was not captured
(:mod:`.phases`; prompt values a later forward replaced, :mod:`.overwrites`; decode steps fed
different tokens, :mod:`.inputs`; step tags a dropped call renumbered, :mod:`.step_drops`; a flat engine's step-0 routing, :mod:`.flat_steps`; a request row its attention mask pads, :mod:`.padding`; prompt calls of different lengths that may be of the same prompt (a prefix cache's tail, a padded prefill), :mod:`.prefix_cache`; what one-row mode cannot see, :mod:`.one_row`; ids an engine's
gates did not give, :mod:`.picked`; keys one side holds,
:mod:`.one_sided`; a side whose process died before the other's keys, :mod:`.ended`), per-key metrics (:mod:`.metrics`, :mod:`.measure`, :mod:`.merged_ranks`, :mod:`.step_scale`), whether
differing expert ids are a near tie (:mod:`.routing`, with :mod:`.selection`, :mod:`.softmax_bias` and :mod:`.cut`) and
what a flip reaches (:mod:`.flips`), the findings (:mod:`.verdict`, :mod:`.jumps`, :mod:`.decode_first`; cautions on a
first divergence that may be noise, :mod:`.cautions`), the typed records and their
JSON (:mod:`.key_record`, :mod:`.report`, with :mod:`.facts`), terminal text (:mod:`.table`, :mod:`.text`),
``--plot`` (:mod:`.plot`) and ``compiledump inspect`` (:mod:`.inspect`).
"""

from ..format.files import collect_dumps
from ..format.reader import DumpError, DumpFile
from .facts import Closest, SideFacts
from .metrics import (CHUNK_ELEMENTS, FloatMetrics, IdMetrics, RowMetrics, Workspace, bf16_spacing,
                      compare_float_arrays, compare_id_arrays, compare_rows)
from .options import (DEFAULT_NEAR_TIE_ULPS, DEFAULT_THRESHOLD, DEFAULT_THRESHOLDS, CompareOptions, Thresholds,
                      pair_class, precision_class)
from .plot import PlotUnavailable, write_plot
from .key_record import KeyRecord, MergeInfo, RankPart
from .report import (ArgmaxFlip, DecodeMargins, Divergence, PairResult, Problem, Report, json_safe, report_json_text,
                     write_json_report)
from .shards import MergedDump
from .table import format_table
from .text import describe_divergence, final_line, format_report
from .verdict import NoCommonKeys, compare, compare_pair

__all__ = [
    "CHUNK_ELEMENTS", "DEFAULT_NEAR_TIE_ULPS", "DEFAULT_THRESHOLD", "DEFAULT_THRESHOLDS", "ArgmaxFlip", "Closest",
    "CompareOptions", "DecodeMargins", "Divergence", "DumpError", "DumpFile", "FloatMetrics", "IdMetrics", "KeyRecord",
    "MergeInfo", "MergedDump", "NoCommonKeys", "PairResult", "PlotUnavailable", "Problem", "RankPart", "Report",
    "RowMetrics", "SideFacts", "Thresholds", "Workspace", "bf16_spacing", "collect_dumps", "compare",
    "compare_float_arrays", "compare_id_arrays", "compare_pair", "compare_rows", "pair_class", "precision_class",
    "describe_divergence", "final_line", "format_report", "format_table", "json_safe", "report_json_text",
    "write_json_report", "write_plot",
]
