"""The on-disk contract: what a dump file is (spec), how it is written (writer) and read (reader).

numpy and the standard library only: the comparator and `compiledump inspect` run without torch.
docs/format.md describes the same contract for people.
"""
