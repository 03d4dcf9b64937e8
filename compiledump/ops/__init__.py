"""The device layer: op schemas, the control-block layout, and the capture kernels.

    layout.py         the control block's words (registers, per-tag counters) and capture kinds
    schemas.py        every `compiledump::` op schema, defined once, with its fake
    geometry.py       what one capture stores, the token gate, how a kernel views its input
    reference.py      the reference kernel (plain torch, CPU)
    triton_kernel.py  the device kernel (Triton; CPU under TRITON_INTERPRET=1) and its launch
    triton_steps.py   the device kernel's steps (Triton device functions it calls in order)
    variants.py       which compiled Triton variant and grid a launch uses; prepared before capture
    native.py         the optional native library (C++/CUDA kernels for the same schemas)
    register.py       which kernel runs; Python kernels of the ops that need no tag registry

Nothing here knows about tags: the registry that maps tags to arena regions is capture/.
"""
