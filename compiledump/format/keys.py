"""What the keys of a dump mean (capture kind, tag, decode step, layer) and the order they are
compared in: from the manifest, or inferred from key names and dtypes for files without one."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Protocol

from . import spec


class Named(Protocol):
    """What inference needs of an npz member (``reader.Member``): its key and whether it holds
    integers."""

    @property
    def key(self) -> str: ...

    @property
    def is_integer(self) -> bool: ...


@dataclass(frozen=True)
class KeyInfo:
    """What a key is: its capture kind, tag, step, layer and capture order."""

    key: str
    kind: str  # one of spec.KINDS
    tag: str
    step: int | None
    layer: int | None
    order: float  # tag's first-capture order (manifest) or member position (inferred)
    from_manifest: bool
    # Optional manifest fields (absent from older manifests and files without one: None).
    source_dtype: str | None = None  # the captured tensor's torch dtype name, e.g. "bfloat16"
    tokens: int | None = None  # shape[0] of the call whose value the dump holds (record kinds, ids)
    written_phase: str | None = None  # "prefill" | "decode": the phase that call belonged to
    all_rows: bool = False  # keys[k].rows == "all": every token position's row, [tokens, dim]

    @property
    def phase(self) -> str:
        """``decode`` for step keys, ``prefill`` for everything else."""
        return "decode" if self.kind == "step" else "prefill"


def info_from_manifest(key: str, entry: Any) -> KeyInfo | None:
    """A key's meaning from its manifest entry ``keys[key]``, or None if the entry is unusable."""
    if not isinstance(entry, dict) or entry.get("kind") not in spec.KINDS:
        return None
    tag = entry.get("tag") if isinstance(entry.get("tag"), str) else key
    step = entry.get("step") if isinstance(entry.get("step"), int) else None
    order = entry.get("order")
    order = float(order) if isinstance(order, (int, float)) else math.inf
    kind = entry["kind"]
    if kind == "step" and step is None:
        return None
    tokens = entry.get("tokens")
    phase = entry.get("phase")
    return KeyInfo(key, kind, tag, step if kind == "step" else None, spec.layer_of(tag), order, True,
                   source_dtype=entry["source_dtype"] if isinstance(entry.get("source_dtype"), str) else None,
                   tokens=tokens if isinstance(tokens, int) and not isinstance(tokens, bool) else None,
                   written_phase=phase if phase in ("prefill", "decode") else None,
                   all_rows=entry.get("rows") == "all")


def infer_key_infos(members: list[Named]) -> dict[str, KeyInfo]:
    """Key meanings for a file without a manifest (debug_dump.py files), from names and dtypes.

    Rules (docs/compare.md, "Files without a manifest"):

    * ``<prefix>_<n>`` (n without leading zeros) is decode step n of tag ``<prefix>`` when the
      file also holds ``<prefix>_0`` (record_step numbers every tag from 0) and, if the prefix is
      itself ``layer<N>``, the family has at least two members (a lone ``layer3_0`` is more
      likely a record tag than a one-step decode).
    * otherwise an integer array is ``ids`` and a float array is a ``record``.
    * the order is the member's position in the npz: debug_dump.py's dict keeps first-insertion
      order and ``np.savez`` writes it as is, so position is first-capture order. A step family
      takes the position of its first member.
    """
    position = {member.key: index for index, member in enumerate(members)}
    families: dict[str, list[tuple[int, str]]] = {}
    for member in members:
        split = spec.split_step_key(member.key)
        if split is not None:
            families.setdefault(split[0], []).append((split[1], member.key))
    step_of: dict[str, tuple[str, int]] = {}
    family_order: dict[str, int] = {}
    for prefix, entries in families.items():
        if 0 not in {step for step, _ in entries}:
            continue
        if spec.LAYER_ONLY.match(prefix) and len(entries) < 2:
            continue
        family_order[prefix] = min(position[key] for _, key in entries)
        for step, key in entries:
            step_of[key] = (prefix, step)
    infos: dict[str, KeyInfo] = {}
    for member in members:
        if member.key in step_of:
            tag, step = step_of[member.key]
            infos[member.key] = KeyInfo(member.key, "step", tag, step, spec.layer_of(tag),
                                        float(family_order[tag]), False)
        else:
            kind = "ids" if member.is_integer else "record"
            infos[member.key] = KeyInfo(member.key, kind, member.key, None, spec.layer_of(member.key),
                                        float(position[member.key]), False)
    return infos


def order_key_infos(infos: list[KeyInfo]) -> list[KeyInfo]:
    """Keys in comparison order: prefill keys first, then decode steps.

    Prefill: tags captured before the first ``layer<N>`` tag (e.g. ``embed``), then layer keys by
    layer number and capture order within the layer, then the remaining non-layer tags (e.g.
    ``final_norm``, ``logits``) in capture order. Decode: by step, then tag capture order.
    """
    prefill = [info for info in infos if info.kind != "step"]
    steps = [info for info in infos if info.kind == "step"]
    layer_orders = [info.order for info in prefill if info.layer is not None]
    first_layer_order = min(layer_orders) if layer_orders else math.inf

    def prefill_rank(info: KeyInfo):
        if info.layer is not None:
            return (1, info.layer, info.order, info.key)
        return (0 if info.order < first_layer_order else 2, 0, info.order, info.key)

    prefill.sort(key=prefill_rank)
    steps.sort(key=lambda info: (info.step, info.order, info.key))
    return prefill + steps


def router_key_for(key: str, step: bool = False) -> str | None:
    """The router-logits key recorded beside an ids key: ``layer3_topk`` -> ``layer3_router``;
    for a step's ids (``step``), the same step's: ``layer3_step_topk_5`` ->
    ``layer3_step_router_5``."""
    if not step:
        return key[: -len("topk")] + "router" if key.endswith("_topk") else None
    parts = spec.split_step_key(key)
    if parts is None or not parts[0].endswith("_topk"):
        return None
    return spec.step_key(parts[0][: -len("topk")] + "router", parts[1])


def prompt_tag_for_step(tag: str) -> str | None:
    """The prompt's tag at the point a step tag records: ``layer3_step_router`` -> ``layer3_router``,
    ``layer3_attn_step`` -> ``layer3_attn``, ``layer3_step`` -> ``layer3``; None for a tag without
    ``_step`` (a step's ``logits``)."""
    twin = re.sub(r"_step(?=_|$)", "", tag, count=1)
    return twin if twin != tag else None


def chosen(key: str | None) -> str:
    """What the ids of `key` (an ids or router key) pick, for the report's words: "keys" for a
    sparse-attention indexer's (`layer<N>_index_...`), else "experts"."""
    return "keys" if key is not None and "_index_" in key else "experts"


def index_ids_key_for(key: str) -> str | None:
    """The ids key beside a sparse-attention indexer's scores (the keys it picks):
    ``layer3_index_router`` -> ``layer3_index_topk``; else None."""
    return key[: -len("router")] + "topk" if key.endswith("_index_router") else None


def step_ids_key_for(key: str) -> str | None:
    """The ids key of the same step beside a step's router-logits key: ``layer3_step_router_5``
    -> ``layer3_step_topk_5``; None for a key not named ``<prefix>_router_<n>``."""
    parts = spec.split_step_key(key)
    if parts is None or not parts[0].endswith("_router"):
        return None
    return spec.step_key(parts[0][: -len("router")] + "topk", parts[1])
