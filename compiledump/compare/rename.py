"""``--map PATTERN=REPLACEMENT``: the RUN side's keys renamed before pairing, for two
implementations that tag the same tensors differently (``--map '^blk(\\d+)\\.out$=layer\\1'``)."""

from __future__ import annotations

import re
from dataclasses import replace

from ..format import spec
from ..format.keys import KeyInfo
from ..format.reader import Dump, KeyProblem, Member, Replica
from .view import DumpView


def split_map(text: str) -> tuple[str, str]:
    """``PATTERN=REPLACEMENT`` split at the first ``=`` not preceded by a backslash: ``\\=`` in
    the pattern is a literal ``=`` (which ``re`` reads as ``=``); the replacement may hold ``=``.
    Raises ValueError without such an ``=`` or with an empty or invalid pattern."""
    index = 0
    while index < len(text):
        if text[index] == "\\":
            index += 2
            continue
        if text[index] == "=":
            break
        index += 1
    else:
        raise ValueError(f"expected PATTERN=REPLACEMENT, got {text!r}")
    pattern, replacement = text[:index], text[index + 1:]
    if not pattern:
        raise ValueError(f"empty PATTERN in {text!r}")
    try:
        compiled = re.compile(pattern)
        compiled.sub(replacement, "")  # checks group references such as \\3 against the pattern
    except (re.error, IndexError) as exc:
        raise ValueError(f"bad --map {text!r}: {exc}") from None
    return pattern, replacement


def rename(name: str, maps: list[tuple[str, str]]) -> str:
    """``name`` with every (pattern, replacement) applied in order by ``re.sub``."""
    for pattern, replacement in maps:
        name = re.sub(pattern, replacement, name)
    return name


class RenamedDump(DumpView):
    """A RUN side seen through ``--map``: the same arrays under new key names. Record, ids and
    once keys are renamed by name; a step key ``<tag>_<n>`` by its tag, keeping ``_<n>``."""

    def __init__(self, inner: Dump, maps: list[tuple[str, str]]) -> None:
        super().__init__(inner)
        self.maps = maps
        self._old: dict[str, str] = {}
        self._left_out: dict[tuple, str | None] = {}  # left_out_by's answers, per tag and patterns
        self.members: dict[str, Member] = {}
        self.infos: dict[str, KeyInfo] = {}
        for old, info in inner.infos.items():
            new_info = self._renamed(info, maps)
            if new_info.key in self._old:
                self.problems.append(KeyProblem("map_collision", new_info.key,
                                                f"RUN keys {self._old[new_info.key]} and {old} both map to "
                                                f"{new_info.key}; {old} is not compared"))
                continue
            self._old[new_info.key] = old
            self.infos[new_info.key] = new_info
            self.members[new_info.key] = inner.members[old]
        self.bad_members = {rename(key, maps): why for key, why in inner.bad_members.items()}
        self.excluded = {rename(key, maps) for key in inner.excluded}
        changed = sum(1 for new, old in self._old.items() if new != old)
        self.notes.append(f"--map renamed {changed} of {len(inner.infos)} keys")

    @staticmethod
    def _renamed(info: KeyInfo, maps: list[tuple[str, str]]) -> KeyInfo:
        if info.kind == "step" and info.step is not None:
            tag = rename(info.tag, maps)
            key = spec.step_key(tag, info.step)
        else:
            key = rename(info.key, maps)
            tag = rename(info.tag, maps) if info.tag != info.key else key
        return replace(info, key=key, tag=tag, layer=spec.layer_of(tag))

    def replicas(self, key: str) -> list[Replica]:
        return self.inner.replicas(self._old[key])

    def router(self, key: str):
        """RUN's router declaration, found under the key's old name (its tag's declaration)."""
        return self.inner.router(self._old.get(key, key))

    def seen_as(self, tag: str) -> str:
        """RUN's own tag `tag` renamed by the map."""
        return rename(self.inner.seen_as(tag), self.maps)

    def left_out_by(self, tag: str, patterns: list[str]) -> str | None:
        """The first of RUN's `instrument(exclude=...)` patterns that left out a RUN tag the map
        renames to `tag` (a REF name). The patterns name RUN's tags before the renaming, so such a
        tag is sought among each pattern's tags (and the tags recorded with them) at the numbers
        `tag` holds: a map that changes layer numbers is not followed."""
        asked = (tag, tuple(patterns))
        if asked not in self._left_out:
            numbers = set(re.findall(r"\d+", tag))
            self._left_out[asked] = next((pattern for pattern in patterns for old in _pattern_tags(pattern, numbers)
                                          if rename(old, self.maps) == tag
                                          and self.inner.left_out_by(old, [pattern]) is not None), None)
        return self._left_out[asked]

    def renamed(self) -> dict[str, str]:
        """New key -> old key, for the keys whose name changed."""
        return {new: old for new, old in self._old.items() if new != old}


def _pattern_tags(pattern: str, numbers: set[str]):
    """The tags an exclude `pattern` leaves out with `{i}` one of `numbers`: the pattern's own, a
    layer's step state beside it, and a router's tags beside `<name>_router` (spec.excluded_by)."""
    for base in {pattern.replace("{i}", number) for number in numbers} if "{i}" in pattern else {pattern}:
        yield base
        yield f"{base}_step"
        if base.endswith("_router"):
            yield from (base[: -len("_router")] + suffix for suffix in spec.ROUTING_SUFFIXES)


__all__ = ["RenamedDump", "rename", "split_map"]
