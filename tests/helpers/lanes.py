"""Which tests CI's second lane runs (`pytest --lane=pure`, tests/conftest.py).

CI (`.ci/run`) runs the suite twice: with the native op library the install built, then with
COMPILEDUMP_NATIVE=0, the pure-Python capture path every machine without a C++ compiler gets.
The two lanes differ in what the library serves: which CPU kernel writes a capture (native C++ or
the Python reference kernel: compiledump/ops/register.py, `run_cpu_kernel`), the host-side gates
and arena placement C++ decides with it (capture/dispatch.py, capture/arena.py), `set_register`,
and whether an AOTInductor program finds the library's shims. Everything else (the runtime's
bookkeeping, its flushes and crash files, the comparator) is the same Python in both. The second lane therefore leaves out
the tests whose outcome cannot depend on the kernel, each for the reason given below; every other
test runs again. tests/repo/test_layout.py checks that each entry still names a test.
"""

# A test's id relative to tests/ ("folder/", "folder/file.py" or "folder/file.py::test_name",
# matched as a prefix) -> why it runs in the native lane only.
NATIVE_LANE_ONLY = {
    "compare/": "the comparator is numpy alone; a test that captures through instrument() first takes "
                "capture paths that tests/ops and tests/capture, which run again, hold equal",
    "format/": "the dump format's names, writer and reader: no capture kernel involved",
    "repo/test_docs.py": "docs checks",
    "repo/test_layout.py": "the repository's layout and imports",
    "repo/test_gpu_scripts.py": "the GPU scripts' CPU modes: their device handling and phases, not the CPU kernel",
    "repo/test_benchmark_scripts.py::test_sweep_routing_prints_its_verdict_table":
        "a slice of the routing sweep: Hugging Face models and the comparator",
    "repo/test_benchmark_scripts.py::test_sweep_engines_prints_its_verdict_table":
        "a slice of the engine sweep: Hugging Face models and the comparator",
    "repo/test_benchmark_scripts.py::test_sweep_routing_counts_where_a_scaled_layer_is_named":
        "a slice of the routing sweep: Hugging Face models and the comparator",
    "repo/test_benchmark_scripts.py::test_a_timing_benchmark_leaves_no_scratch_directory":
        "where a timing benchmark's scratch directory goes and that the exit flush leaves it removed: Python "
        "around the kernel",
    "native/test_native_build.py": "setup.py's commands and packaging: the same in either lane",
    "native/test_cuda_kernel_emulated.py": "the CUDA kernel compiled into its own harness, whatever the path",
    "native/test_native_kernel_sass.py": "nvcc compiles the CUDA kernel for sm_90, whatever the path",
    "native/test_dump_names.py": "the C++ flush's naming program (the C++ API), whatever serves Python's captures",
    # test_aot.py's tests that capture nothing; its exports, packages and plans run again.
    "export/test_aot.py::test_layout_header_matches_python": "kernels/layout.h's constants against Python's: text",
    "export/test_aot.py::test_schemas_header_is_current": "kernels/schemas.h against its renderer: text",
    "export/test_aot.py::test_export_is_told_from_compile_by_torch_export_alone":
        "which flag torch.export and torch.compile set (a function without captures)",
    "export/test_aot.py::test_a_cuda_proxy_package_warns_before_it_loads":
        "load()'s warning, read from a package's metadata (the loader stubbed: nothing runs)",
    "export/test_aot.py::test_driver_usage_and_bad_package": "the C++ driver's usage and errors: no capture",
    "ops/test_variants.py": "the Triton kernel's variants (Triton interpreted: no native code)",
    "ops/test_triton_layout_classes.py": "the Triton kernel's layout classes and PTX (no native code)",
    # Hugging Face models through instrument() and the comparator, several Inductor-compiled: the
    # first lane's costliest files; the kernels they capture through are held equal by tests/ops.
    "capture/test_hf_models.py": "Hugging Face engines (Inductor compiles), instrument() and the comparator",
    "capture/test_hf_indexers.py": "Hugging Face sparse-attention indexers, instrument() and the comparator",
    "capture/test_dense_layers.py": "Hugging Face dense layouts, instrument() and the comparator",
    "capture/test_gpt2_family.py": "Hugging Face GPT-2-family layouts, instrument() and the comparator",
    "capture/test_vlm_layouts.py": "Hugging Face vision-language layouts, instrument() and the comparator",
    "capture/test_recurrent_layouts.py": "Hugging Face recurrent layouts, instrument() and the comparator",
    "capture/test_dbrx.py": "Hugging Face DBRX layout, instrument() and the comparator",
    "capture/test_encoder_decoder.py": "Hugging Face encoder-decoder layouts, instrument() and the comparator",
    "capture/test_t5_family.py": "Hugging Face T5-family layouts, instrument() and the comparator",
    "capture/test_bert_family.py": "Hugging Face BERT-family layouts, instrument() and the comparator",
    "capture/test_reference_layouts.py": "reference-code layouts, instrument() and the comparator",
    # Child processes killed at random moments: the pure kernel commits each capture as the native
    # one does, which the deterministic commit-counter tests of the same file (run again) decide
    # without timing luck.
    "capture/test_crash.py::test_sigkill_at_100_moments": "random kills of a compiled child",
    "capture/test_crash.py::test_real_sigkill": "random kills of a compiled child",
    "capture/test_process_death.py": "how a process ended (excepthook, a signal's flush), recover's handling of "
                                     "unstarted crash files and compare's note: Python around the kernel",
    "capture/test_crash_leftovers.py": "the journal's and recover's bookkeeping: Python around the kernel",
}

# A word in a test's id -> why every test whose id holds it runs in the native lane only.
NATIVE_LANE_ONLY_WORDS = {
    "triton": "the interpreted Triton kernel against the reference kernel, or CPU captures routed to it "
              "(COMPILEDUMP_CPU_KERNEL=triton): the same code whichever CPU path is installed",
}


def native_lane_only(nodeid: str) -> bool:
    """Whether the test `nodeid` (as pytest gives it, from the repository root) is left out of the
    pure lane. Given a file or folder path relative to tests/ (a folder ending in "/"), whether
    every test under it is (tests/conftest.py then does not import it in that lane)."""
    test = nodeid.split("tests/", 1)[-1]
    return (any(test.startswith(prefix) for prefix in NATIVE_LANE_ONLY)
            or any(word in nodeid for word in NATIVE_LANE_ONLY_WORDS))
