"""The capture side: what a model calls, and everything the process keeps until the flush.

    api.py       the public calls (configure, init, record*, profiling, set_rows, ...)
    state.py     the one state object and its locks; reset()
    arena.py     the device arena, the control block and the tag registry (slots, regions)
    dispatch.py  the kernels of compiledump::capture_v1 (registry lookup, then ops/), eager and export paths
    flush.py     one host copy at flush, sliced into arrays + manifest (format/writer.py writes them)
    collect.py   a snapshot sliced by the registry (commit counter, non-finite words): flush and recover
    persist.py   crash-proof capture: arena and control block as mapped files, the registry's journal
    recover.py   `compiledump recover`: what a dead process left, turned into a dump (numpy only)
    parallel.py  multi-rank metadata for the manifest (set_parallel, declare_shard)
    signals.py   flush on SIGTERM/SIGINT, then the signal's own action
"""
