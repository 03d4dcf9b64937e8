"""The base of the comparator's views of a side (``--map``'s renaming, a padded request row's
real positions, derived expert ids): one dump seen through another, sharing its arrays."""

from __future__ import annotations

from ..format.reader import Dump, Replica


class DumpView(Dump):
    """`inner` as it is: its key containers copied (shallowly, so a view can add or drop keys
    without touching `inner`), its manifest and ranks shared, replicas and routers asked of
    `inner`. Subclasses change what they see differently after ``super().__init__(inner)``."""

    def __init__(self, inner: Dump) -> None:
        self.inner = inner
        self.path, self.label = inner.path, inner.label
        self.manifest, self.merged_ranks = inner.manifest, inner.merged_ranks
        self.notes, self.problems = list(inner.notes), list(inner.problems)
        self.bad_members, self.excluded = dict(inner.bad_members), set(inner.excluded)
        self.members, self.infos = dict(inner.members), dict(inner.infos)

    def replicas(self, key: str) -> list[Replica]:
        return self.inner.replicas(key)

    def router(self, key: str):
        """`inner`'s declaration: a router is declared under the name `inner`'s tags have."""
        return self.inner.router(key)

    def seen_as(self, tag: str) -> str:
        return self.inner.seen_as(tag)

    def rank_manifests(self) -> list[dict]:
        return self.inner.rank_manifests()

    def left_out_by(self, tag: str, patterns: list[str]) -> str | None:
        """`inner`'s answer: a view that keeps `inner`'s names keeps what its patterns left out."""
        return self.inner.left_out_by(tag, patterns)


__all__ = ["DumpView"]
