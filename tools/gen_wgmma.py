"""Writes csrc/cuda/matmul/wgmma_ops.cuh: the wgmma.mma_async wrappers, whose operand lists (one
register per accumulator, 64-128 of them) are too long to keep by hand. Two forms per N: A from a
shared-memory descriptor (the matmul, attention's S = Q Kᵀ) and A from registers (attention's
O += P V, P never leaving the registers). And the tf32 form m64nNk8 for fp32 matmuls under TF32:
both operands K-major from shared memory (tf32 has no transpose bits), or A from registers (_tf32_rs:
the matmul's N-major B, loaded by the threads themselves, D-132).

    python tools/gen_wgmma.py      # rewrites the header; commit both
"""
import os

SHAPES = (64, 128, 256)  # N of the m64nNk16 instructions the matmul kernels take
SS_EXTRA = (176, 192)    # and attention's S = Q Kᵀ with 176 / 192 keys a tile (A/B of the key tile)
TYPES = {"__nv_bfloat16": "bf16", "__half": "f16"}
TF32_SHAPES = (128,)     # N of the m64nNk8 tf32 instructions (the matmul's 128 x 128 tile)


def wrapper(n):
    regs = n // 2
    acc = ", ".join(f"%{i}" for i in range(regs))
    outs = ", ".join(f'"+f"(d[{i}])' for i in range(regs))
    a, b, scale, ta, tb = regs, regs + 1, regs + 2, regs + 3, regs + 4
    lines = [f"// d (+)= A (64 x 16, smem descriptor) * B (16 x {n}, smem descriptor); scale_d 0 overwrites d.",
             "// kTransA / kTransB: 0 = K-major operand, 1 = M- / N-major (16-bit types only).",
             f"template <typename T, int kTransA, int kTransB>",
             f"__device__ __forceinline__ void wgmma_m64n{n}k16(float (&d)[{regs}], uint64_t desc_a, uint64_t desc_b, int scale_d) {{",
             "#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)"]
    for t, ptx in TYPES.items():
        kw = "if constexpr" if t == "__nv_bfloat16" else "} else {"
        lines.append(f"    if constexpr (std::is_same_v<T, {t}>) {{" if kw == "if constexpr" else "    } else {")
        lines.append('        asm volatile("{\\n.reg .pred p;\\nsetp.ne.b32 p, %' + str(scale) + ', 0;\\n"')
        lines.append(f'                     "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{ptx}.{ptx} "')
        lines.append(f'                     "{{{acc}}}, "')
        lines.append(f'                     "%{a}, %{b}, p, 1, 1, %{ta}, %{tb};\\n}}\\n"')
        lines.append(f"                     : {outs}")
        lines.append(f'                     : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(kTransA), "n"(kTransB));')
    lines.append("    }")
    lines.append("#endif")
    lines.append("}")
    return "\n".join(lines)


def wrapper_rs(n):
    regs = n // 2
    acc = ", ".join(f"%{i}" for i in range(regs))
    outs = ", ".join(f'"+f"(d[{i}])' for i in range(regs))
    a = ", ".join(f"%{regs + i}" for i in range(4))
    b, scale, tb = regs + 4, regs + 5, regs + 6
    lines = [f"// d (+)= A (64 x 16, four registers of two 16-bit values a thread, the m64nNk16 accumulator",
             f"// layout) * B (16 x {n}, smem descriptor); scale_d 0 overwrites d. kTransB as above.",
             f"template <typename T, int kTransB>",
             f"__device__ __forceinline__ void wgmma_m64n{n}k16_rs(float (&d)[{regs}], const uint32_t (&a)[4], uint64_t desc_b, int scale_d) {{",
             "#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)"]
    for t, ptx in TYPES.items():
        lines.append(f"    if constexpr (std::is_same_v<T, {t}>) {{" if t == "__nv_bfloat16" else "    } else {")
        lines.append('        asm volatile("{\\n.reg .pred p;\\nsetp.ne.b32 p, %' + str(scale) + ', 0;\\n"')
        lines.append(f'                     "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{ptx}.{ptx} "')
        lines.append(f'                     "{{{acc}}}, "')
        lines.append(f'                     "{{{a}}}, %{b}, p, 1, 1, %{tb};\\n}}\\n"')
        lines.append(f"                     : {outs}")
        lines.append(f'                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d), "n"(kTransB));')
    lines.append("    }")
    lines.append("#endif")
    lines.append("}")
    return "\n".join(lines)


def wrapper_tf32(n):
    regs = n // 2
    acc = ", ".join(f"%{i}" for i in range(regs))
    outs = ", ".join(f'"+f"(d[{i}])' for i in range(regs))
    a, b, scale = regs, regs + 1, regs + 2
    lines = [f"// d (+)= A (64 x 8, smem descriptor) * B (8 x {n}, smem descriptor), tf32 operands (fp32 in",
             "// shared memory, read as tf32), both K-major; scale_d 0 overwrites d.",
             f"__device__ __forceinline__ void wgmma_m64n{n}k8_tf32(float (&d)[{regs}], uint64_t desc_a, uint64_t desc_b, int scale_d) {{",
             "#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)",
             '    asm volatile("{\\n.reg .pred p;\\nsetp.ne.b32 p, %' + str(scale) + ', 0;\\n"',
             f'                 "wgmma.mma_async.sync.aligned.m64n{n}k8.f32.tf32.tf32 "',
             f'                 "{{{acc}}}, "',
             f'                 "%{a}, %{b}, p, 1, 1;\\n}}\\n"',
             f"                 : {outs}",
             '                 : "l"(desc_a), "l"(desc_b), "r"(scale_d));',
             "#endif",
             "}"]
    return "\n".join(lines)


def wrapper_tf32_rs(n):
    regs = n // 2
    acc = ", ".join(f"%{i}" for i in range(regs))
    outs = ", ".join(f'"+f"(d[{i}])' for i in range(regs))
    a = ", ".join(f"%{regs + i}" for i in range(4))
    b, scale = regs + 4, regs + 5
    lines = [f"// d (+)= A (64 x 8, four registers of one tf32 a thread: rows g and g + 8 of the warp's 16, columns",
             f"// t and t + 4, g = lane / 4, t = lane % 4, as a0 (g, t) a1 (g + 8, t) a2 (g, t + 4) a3 (g + 8, t + 4))",
             f"// * B (8 x {n}, smem descriptor, K-major); scale_d 0 overwrites d.",
             f"__device__ __forceinline__ void wgmma_m64n{n}k8_tf32_rs(float (&d)[{regs}], const uint32_t (&a)[4], uint64_t desc_b, int scale_d) {{",
             "#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)",
             '    asm volatile("{\\n.reg .pred p;\\nsetp.ne.b32 p, %' + str(scale) + ', 0;\\n"',
             f'                 "wgmma.mma_async.sync.aligned.m64n{n}k8.f32.tf32.tf32 "',
             f'                 "{{{acc}}}, "',
             f'                 "{{{a}}}, %{b}, p, 1, 1;\\n}}\\n"',
             f"                 : {outs}",
             '                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));',
             "#endif",
             "}"]
    return "\n".join(lines)


def main():
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "csrc", "cuda", "matmul", "wgmma_ops.cuh")
    body = "\n\n".join([wrapper(n) for n in sorted(SHAPES + SS_EXTRA)] + [wrapper_rs(n) for n in SHAPES]
                       + [wrapper_tf32(n) for n in TF32_SHAPES] + [wrapper_tf32_rs(n) for n in TF32_SHAPES])
    text = ("// Generated by tools/gen_wgmma.py: do not edit by hand.\n"
            "// wgmma.mma_async wrappers (sm_90a), fp32 accumulators, bf16 / fp16 operands: A and B from shared\n"
            "// memory, or A from registers (_rs) and B from shared memory; tf32 (_tf32) from shared memory, or A\n"
            "// from registers (_tf32_rs).\n"
            "#pragma once\n\n#include <cuda_bf16.h>\n#include <cuda_fp16.h>\n#include <stdint.h>\n\n"
            "#include <type_traits>\n\nnamespace fk::mm {\n\n"
            + body + "\n\n}  // namespace fk::mm\n")
    with open(out, "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
