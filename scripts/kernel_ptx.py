"""Compile the Triton capture kernel for sm_90 without a GPU and report what the PTX/SASS says.

    python scripts/kernel_ptx.py            # table: loads, stores, 32-bit multiplies, atomics, registers
    python scripts/kernel_ptx.py --check    # exit 1 unless the fast paths use 16-byte vector loads
                                            # and stores, no offset is multiplied in 32 bits, the
                                            # registers are agreed block-wide before the claim, a
                                            # clean call branches around the NaN/Inf atomics and the
                                            # payload is in flight through the claim (no register
                                            # loaded after it)
    python scripts/kernel_ptx.py --all      # also compile every input type and layout class

Run it without TRITON_INTERPRET (the test suite does, in a subprocess). Triton's bundled ptxas
assembles the PTX; registers and SASS memory instructions come from its bundled cuobjdump.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

if os.environ.get("TRITON_INTERPRET"):
    sys.exit("kernel_ptx.py: unset TRITON_INTERPRET (the interpreter compiles nothing)")

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from compiledump.ops import triton_kernel as K
from compiledump.ops.variants import BLOCK, NUM_WARPS, Variant, vector_width

import sass_control  # noqa: E402 - scripts/, beside this file

# (input type, MEAN, IS_INT, VEC, input 16-byte aligned[, host-mapped arena[, release commit[, payload
# first]]]): the fast paths, then a slow path, then the crash-proof arena's commit, then a relaxed
# commit, then the payload loaded after the claim.
VARIANTS = [
    ("bf16", True, False, 8, True),  # record of [T, hc, dim] bf16: hc mean
    ("fp32", False, False, 4, True),  # record/step of [T, dim] fp32: copy
    ("i64", False, True, 2, True),  # record_ids
    ("bf16", True, False, 1, False),  # unaligned input: scalar loads
    ("bf16", True, False, 8, True, True),  # into a host-mapped arena: the commit at system scope
    ("bf16", True, False, 8, True, False, False),  # a relaxed commit (gpu_bench times it beside the release)
    ("bf16", True, False, 8, True, False, True, False),  # the claim first (gpu_bench times it beside the default)
]
# Every input type the kernel takes (Triton's name: torch's dtype), in every layout class (--all).
ALL_TYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "fp64": torch.float64,
             "fp8e4nv": torch.float8_e4m3fn, "fp8e5": torch.float8_e5m2, "i1": torch.bool, "i8": torch.int8,
             "i16": torch.int16, "i32": torch.int32, "i64": torch.int64, "u8": torch.uint8, "u16": torch.uint16,
             "u32": torch.uint32, "u64": torch.uint64}


def compile_variant(xty: str, mean: bool, is_int: bool, vec: int, aligned: bool, host_arena: bool = False,
                    release: bool = True, payload_first: bool = True):
    signature = {"x_ptr": "*" + xty, "arena_ptr": "*fp32", "ctrl_ptr": "*i32"}
    signature.update({name: "i64" for name in K.INT_ARGS})
    constexprs = K.constexprs(Variant(ALL_TYPES[xty], mean, is_int, vec, aligned, host_arena, release or host_arena,
                                      payload_first))
    signature.update({name: "constexpr" for name in constexprs})
    # The arena and control block are always 16-byte aligned; the input as the variant says.
    aligned_args = [(0,)] * aligned + [(1,), (2,)]
    attrs = {arg: [["tt.divisibility", 16]] for arg in aligned_args}
    source = ASTSource(fn=K.capture_kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": NUM_WARPS})


def _sass(cubin: bytes) -> dict:
    """Registers and the memory instructions of the SASS, from Triton's bundled cuobjdump."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not cubin or not os.path.exists(tool):
        return {"sass": "no cuobjdump"}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        usage = subprocess.run([tool, "--dump-resource-usage", path], capture_output=True, text=True).stdout
        sass = subprocess.run([tool, "-sass", path], capture_output=True, text=True).stdout
    regs = re.search(r"REG:(\d+)", usage)
    ops = re.findall(r"\b((?:LDG|STG|ATOMG|RED|MEMBAR)[A-Z0-9._]*)", sass)
    # Payload first: the first masked load (the payload's; the registers' are unmasked) is in
    # flight through the claim's atomic (True: nothing waits for it before the atomic issues;
    # False: something does; None: it is issued after the claim).
    in_flight = sass_control.in_flight_through(sass_control.parse(sass), r"^@!?P\d+\s+LDG", r"ATOMG\.E\.ADD")
    return {"registers": int(regs.group(1)) if regs else None, "sass": {op: ops.count(op) for op in sorted(set(ops))},
            "payload in flight through the claim": in_flight}


def _branched_around(ptx: str, instruction: str) -> bool:
    """True if every `instruction` in the PTX lies between a conditional branch and the label it
    jumps to, further down: a call that takes the branch never issues it (nor waits for it)."""
    lines = ptx.splitlines()
    found = [i for i, line in enumerate(lines) if instruction in line]
    labels = {line.split(":")[0].strip(): i for i, line in enumerate(lines) if re.match(r"\s*\$L__BB\w+:", line)}
    branches = [(i, labels.get(m.group(1), -1)) for i, line in enumerate(lines)
                if (m := re.search(r"@!?%p\d+\s+bra\s+(\$L__BB\w+);", line))]
    return bool(found) and all(any(b < i < target for b, target in branches) for i in found)


def _no_register_after_the_claim(ptx: str) -> bool:
    """No unmasked load (a register's) between the claim's atomic and the first store, in program
    order, which ptxas keeps for memory operations around an atomic: a register loaded after the
    claim is one more dependent round trip to memory before the stores."""
    lines = ptx.splitlines()
    claim = next((i for i, line in enumerate(lines) if "atom.global" in line), len(lines))
    store = next((i for i, line in enumerate(lines) if "st.global" in line), len(lines))
    return not any(claim < i < store and not line.lstrip().startswith("@")
                   for i, line in enumerate(lines) if "ld.global" in line)


def _payload_where_expected(info: dict, payload_first: bool, ids: bool) -> bool:
    """Whether the payload's first load sits where the variant says: in flight through the claim
    (True), or for ids issued before it (False allowed: Triton 3.6's ptxas copies the first int64
    load's low words to another register at once, a move that waits for the load, no worse than
    loading after the claim; Triton 3.9 keeps it in flight); after the claim (None) when the
    variant loads it there. Not checked without cuobjdump."""
    if "payload in flight through the claim" not in info:
        return True
    in_flight = info["payload in flight through the claim"]
    if not payload_first:
        return in_flight is None
    return in_flight is not None if ids else in_flight is True


def describe(kernel) -> dict:
    ptx = kernel.asm["ptx"]
    return {
        "loads": sorted(set(re.findall(r"ld\.global(?:\.[a-z0-9]+)*", ptx))),
        "stores": sorted(set(re.findall(r"st\.global(?:\.[a-z0-9]+)*", ptx))),
        "mul.lo.s32": ptx.count("mul.lo.s32"),
        "mul.lo.s64": ptx.count("mul.lo.s64"),
        "atomics": sorted(set(re.findall(r"(?:atom|red)\.global(?:\.[a-z0-9]+)*", ptx))),  # red: result unused
        # The header registers are agreed block-wide (a reduction through shared memory, so a
        # bar.sync) before the claim, the first atomic: no thread acts on its own racing read.
        "registers agreed before the claim": -1 < ptx.find("bar.sync") < ptx.find("atom.global"),
        "clean call skips the NaN/Inf bookkeeping": _branched_around(ptx, "atom.global.relaxed.gpu.cas"),
        "no register loaded after the claim": _no_register_after_the_claim(ptx),
        **_sass(kernel.asm.get("cubin", b"")),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 unless the fast paths vectorize")
    parser.add_argument("--all", action="store_true",
                        help="also compile every input type in every layout class (fast-path variant)")
    args = parser.parse_args(argv)
    ok = True
    if args.all:
        failed, compiled = [], 0
        for xty, dtype in ALL_TYPES.items():
            width = vector_width(dtype)
            layouts = [(False, True)] if not dtype.is_floating_point else []
            layouts += [(True, False), (False, False)]
            for mean, is_int in layouts:
                # The fast path: the other two variants of a family differ only in hints.
                compiled += 1
                try:
                    compile_variant(xty, mean, is_int, width, True)
                except Exception as error:  # noqa: BLE001 - reported, the others still compile
                    failed.append(f"{xty} mean={mean} int={is_int}: {str(error).splitlines()[-1]}")
        print(f"--all: {len(failed)} variant(s) failed to compile, of {compiled}" + "".join(f"\n  {f}" for f in failed))
        ok = not failed
    print(f"triton {triton.__version__}, sm_90, BLOCK {BLOCK}, {NUM_WARPS} warps")
    for variant in VARIANTS:
        info = describe(compile_variant(*variant))
        print(f"{variant}: {info}")
        fast = variant[3] > 1
        if fast and not any(".v4" in s or ".v2.b64" in s for s in info["loads"]):
            ok = False
            print(f"  NOT VECTORIZED: {variant} loads {info['loads']}")
        if fast and not any(".v4" in s or ".v2" in s for s in info["stores"]):
            ok = False
            print(f"  NOT VECTORIZED: {variant} stores {info['stores']}")
        if info["mul.lo.s32"]:
            ok = False
            print(f"  32-BIT OFFSET MATH: {variant}")
        if not info["registers agreed before the claim"]:
            ok = False
            print(f"  EACH THREAD DECIDES FROM ITS OWN REGISTER READS: {variant}")
        if not info["clean call skips the NaN/Inf bookkeeping"]:
            ok = False
            print(f"  EVERY CALL WAITS FOR THE NaN/Inf COMPARE-AND-SWAP: {variant}")
        payload_first = len(variant) < 8 or variant[7]
        if not info["no register loaded after the claim"] or not _payload_where_expected(info, payload_first,
                                                                                          ids=variant[2]):
            ok = False
            print(f"  A DEPENDENT ROUND TRIP AFTER THE CLAIM (a register loaded after it), OR THE PAYLOAD NOT WHERE "
                  f"THE VARIANT SAYS: {variant}")
        release = len(variant) < 7 or variant[6]
        if release and not any(".release" in a for a in info["atomics"]):
            ok = False
            print(f"  COMMIT NOT A RELEASE: {variant} atomics {info['atomics']}")
        host_arena = len(variant) > 5 and variant[5]
        if host_arena and not any(".sys" in a for a in info["atomics"]):
            ok = False
            print(f"  COMMIT NOT AT SYSTEM SCOPE: {variant} atomics {info['atomics']}")
    if ok:
        print("fast paths vectorized, offsets 64-bit, host-mapped commit at system scope, "
              "one register snapshot per program, no NaN/Inf atomics on a clean call, "
              "payload in flight through the claim (ids: issued before it)")
    return 0 if ok or not args.check else 1


if __name__ == "__main__":
    sys.exit(main())
