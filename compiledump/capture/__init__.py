"""The capture side: what a model calls, and everything the process keeps until the flush.

    api.py         the public calls (configure, init, record*, flush, ...)
    registers.py   profiling, set_rows, set_gather_rows, enabled: the run-time registers the kernels read
    instrument.py  instrument(model): forward hooks that call api.py on a model's modules
    default_taps.py the taps instrument attaches to a decoder-only LM by default
    hf_layout.py   where a Hugging Face decoder keeps its layers, norms, MLP blocks and routers
    hf_configs.py  what a model's config says: an encoder-decoder, a tower feeding the token embeddings
    hf_ends.py     what sits around the layers: token embedding, final norm, head, base model (and PP placeholders)
    residual.py    where a layer keeps the residual stream (vLLM/SGLang: two parts, added by the next norm)
    router_taps.py the hooks on a model's routers: what a router returns, what instrument records of it
    shared_experts.py an MoE block's shared expert, recorded as the block adds it (gated; a TP partial sum)
    hf_routers.py  which Hugging Face routers select how (the rules instrument declares)
    layouts.py     how record reads a tensor (layout=, rows=)
    routers.py     declare_router: how a router that is not a plain top-k selects, for compare
    mixers.py      each tapped layer's token mixer, for the manifest
    indexers.py    a sparse-attention indexer's scores and picks, recorded as routing
    state.py       the one state object and its locks; reset()
    arena.py       the device arena, the control block and the tag registry (slots, regions)
    step_budget.py how many decode steps the arena keeps of a step tag (the sublayers' share)
    dispatch.py    the kernels of compiledump::capture_v1 (registry lookup, then ops/), eager and export paths
    flush.py       one host copy at flush, sliced into arrays + manifest (format/writer.py writes them)
    collect.py     a snapshot sliced by the registry (commit counter, non-finite words): flush and recover
    persist.py     crash-proof capture: arena and control block as mapped files, the registry's journal
    journal.py     reading a crash-proof journal: the registry it replays, its flushes, its process
    recover.py     `compiledump recover`: what a dead process left, turned into a dump (numpy only)
    parallel.py    multi-rank metadata for the manifest (set_parallel, declare_shard)
    signals.py     flush on SIGTERM/SIGINT, then the signal's own action
"""
