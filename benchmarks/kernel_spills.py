"""The sampling kernel's registers and spills at several tiles, compiled here for a GPU this machine need
not have: Triton lowers `_sample_kernel` to PTX for the target (sm_90: H100 / H200) and its bundled ptxas
reports what each thread uses. A CPU-only host can screen tiles before GPU time measures them (the
installed Triton's compiler: the GPU machine's may differ, so the counts are a guide, not its figures).

    python benchmarks/kernel_spills.py [--tiles 4096x16x0,4096x16x1024] [--arch 90]

A tile: block x warps x lanes (0: the block) [x registers a thread at most]; each with and without penalties,
the rows' order on (the Sampler's variant), for the logits' dtype (--dtype: bf16, the model's, or fp32);
--variants: also without the order and the threshold mode.
The pointers, the row stride and the vocabulary are marked divisible by 16, as a launch on [B, 128256]
logits specializes them: without that Triton cannot vectorize the loads and compiles another kernel
(sizePerThread 1; 128 registers for bf16 where the launched kernel gets 64). Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.getcwd())

POINTERS = {  # _sample_kernel's pointer arguments as the Sampler passes them
    "x_ptr": "*bf16", "temp_ptr": "*fp32", "min_p_ptr": "*fp32", "top_k_ptr": "*fp32", "top_p_ptr": "*fp32",
    "keys_ptr": "*i64", "out_ptr": "*i64", "slots_ptr": "*fp32", "pvals_ptr": "*fp32", "counts_ptr": "*i32",
    "prompt_ptr": "*i1", "order_ptr": "*fp32",
}  # fmt: skip


def spills(
    kernel,
    arch: int,
    block: int,
    warps: int,
    lanes: int,
    penalty: bool,
    maxnreg: int = 0,
    dtype: str = "bf16",
    thresh: bool = False,
    order: bool = True,
) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from foveal.sample import triton_sample as ts

    const = dict(THRESH=thresh, PENALTY=penalty, ORDER=order, BLOCK=block, LANES=lanes or block,
                 MAX_STEPS=ts._MAX_STEPS)  # fmt: skip
    names = kernel.arg_names
    sig = {n: POINTERS.get(n, "constexpr" if n in const else "i32") for n in names}
    sig["x_ptr"] = f"*{dtype}"
    if thresh:  # thresholds(): float32 out, the top_k column standing in for the keys
        sig["out_ptr"] = sig["keys_ptr"] = "*fp32"
    wide = set(POINTERS) | {"x_stride", "V"}
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n in wide}
    src = ASTSource(fn=kernel, signature=sig, constexprs={(names.index(n),): v for n, v in const.items()},
                    attrs=aligned)  # fmt: skip
    opts = {"num_warps": warps, **({"maxnreg": maxnreg} if maxnreg else {})}
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=opts)
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    found = [os.path.join(bindir, n) for n in ("ptxas-blackwell", "ptxas")]  # the newer PTX first
    ptxas = next(p for p in found if os.path.exists(p))
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(compiled.asm["ptx"])
        f.flush()
        r = subprocess.run([ptxas, f"-arch=sm_{arch}a", "-v", f.name, "-o", os.devnull], capture_output=True,
                           text=True)  # fmt: skip
    text = r.stdout + r.stderr
    regs = re.search(r"Used (\d+) registers", text)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    if regs is None:
        return {"error": text.strip()[-300:]}
    return {"registers": int(regs.group(1)), "spill_stores": int(spill.group(1)) if spill else 0,
            "spill_loads": int(spill.group(2)) if spill else 0}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiles", default="4096x16x0,4096x16x1024,4096x16x2048,2048x8x0,1024x4x0,4096x8x1024")
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"), help="the logits' dtype")
    ap.add_argument("--variants", action="store_true",
                    help="also the rows in their own order and the threshold mode (filter())")  # fmt: skip
    a = ap.parse_args()
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    from foveal.sample import triton_sample as ts

    kernel, res = ts._triton_kernel(), {}
    for tile in a.tiles.split(","):
        block, warps, lanes, maxnreg = (*(int(v) for v in tile.split("x")), 0)[:4]
        kinds = [(False, False, True), (False, True, True)]  # (threshold mode, penalties, rows' order)
        if a.variants:
            kinds += [(False, False, False), (False, True, False), (True, False, True), (True, False, False)]
        for thresh, penalty, order in kinds:
            name = f"{tile} {'thresholds' if thresh else 'penalties' if penalty else 'plain'}"
            name += "" if order else " (own order)"
            res[name] = spills(kernel, a.arch, block, warps, lanes, penalty, maxnreg, a.dtype, thresh, order)
            print(f"{name}: {res[name]}", flush=True)
    import triton

    head = {"benchmark": "kernel_spills", "triton": triton.__version__, "arch": a.arch, "dtype": a.dtype}
    print(json.dumps({**head, **res}))


if __name__ == "__main__":
    main()
