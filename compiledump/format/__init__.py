"""The on-disk contract: what a dump file is (spec.py), how it is written (writer.py) and read
(reader.py; keys.py says what keys mean and their model order; routers.py a router's declared
selection as the manifest holds it; files.py which files a path names, one per rank).

numpy and the standard library only: the comparator and `compiledump inspect` run without torch.
docs/format.md describes the same contract for people.
"""
