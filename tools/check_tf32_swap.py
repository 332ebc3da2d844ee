"""Offline check of wgmma_sm90.cu's swapped TF32 path (D-132) without a GPU: emulates, for one 128 x 128 tile and
one 32-wide k-tile, the TMA's swizzled boxes, each thread's fragment loads (swapped_col), the wgmma A-fragment and
accumulator layouts, the staging stores and the TMA-store boxes, checks C against x @ w, and counts shared-memory
wavefronts per half warp of the fragment loads and staging stores (1 = conflict-free). Keep swapped_col and the
offsets in step with the kernel when changing either.

    python tools/check_tf32_swap.py
"""
import numpy as np
rng = np.random.default_rng(0)
K, BM, BN = 32, 128, 128
x = rng.standard_normal((BM, K)).astype(np.float32)   # A tile: rows m, K-major
w = rng.standard_normal((K, BN)).astype(np.float32)   # B tile: rows k, N-major

def swz(row, col):  # offset inside a box of 128-byte rows of 32 fp32, 128B swizzle
    return row * 32 + (((col // 4) ^ (row % 8)) * 4) + col % 4

# B stage: 4 boxes (n0 + 32 h), each 32 k-rows x 32 n
sb = np.full(4 * 1024, np.nan, np.float32)
for h in range(4):
    for k in range(32):
        for ni in range(32):
            sb[h * 1024 + swz(k, ni)] = w[k, 32 * h + ni]

def swapped_col(t):
    u, g = t // 32, (t % 32) // 4
    h, p = 2 * (u % 2) + g // 4, g % 4
    return 32 * (u // 2) + 4 * ((h ^ 5) if p // 2 else h) + 2 * (p % 2)

C = np.full((BM, BN), np.nan, np.float32)
for c in range(2):
    # A operand (64 rows x 32 k) as the hardware sees it from the fragments
    Aop = np.full((64, 32), np.nan, np.float32)
    nrow = np.full(64, -1)
    for t in range(128):
        col = 64 * c + swapped_col(t); box = col // 32; chunk = col % 32 // 4
        at = [box * 1024 + (t % 4 + 4 * q) * 32 + ((chunk ^ (t % 4 + 4 * q)) * 4) + col % 4 for q in range(2)]
        u, lane = t // 32, t % 32; g, tq = lane // 4, lane % 4
        for kk in range(4):
            lo = sb[at[0] + kk * 256: at[0] + kk * 256 + 2]; hi = sb[at[1] + kk * 256: at[1] + kk * 256 + 2]
            frag = [lo[0], lo[1], hi[0], hi[1]]
            # a0 (g, t) a1 (g + 8, t) a2 (g, t + 4) a3 (g + 8, t + 4), rows 16 u + ..
            for i, (r, kc) in enumerate([(g, tq), (g + 8, tq), (g, tq + 4), (g + 8, tq + 4)]):
                Aop[16 * u + r, 8 * kk + kc] = frag[i]
        nrow[16 * u + g] = 64 * c + swapped_col(t) - 0
        nrow[16 * u + g + 8] = 64 * c + swapped_col(t) + 1
    assert not np.isnan(Aop).any()
    for r in range(64):
        assert np.array_equal(Aop[r], w[:, nrow[r]]), r
    D = Aop.astype(np.float64) @ x.T.astype(np.float64)   # 64 x 128: rows as above, cols m
    # accumulator layout: d[4j + 2h + e] at row 16u + g + 8h, col 8j + 2 tq + e
    out = np.full(64 * BN, np.nan, np.float32)
    def staged_at(r, col): return (col // 32) * 64 * 32 + r * 32 + (((col % 32 // 4) ^ (r % 8)) * 4) + col % 4
    for t in range(128):
        u, lane = t // 32, t % 32; g, tq = lane // 4, lane % 4
        acc = np.zeros(64)
        for j in range(16):
            for h in range(2):
                for e in range(2):
                    acc[4 * j + 2 * h + e] = D[16 * u + g + 8 * h, 8 * j + 2 * tq + e]
        col = swapped_col(t); row_lane = 2 * (t % 4)
        for j in range(16):
            for e in range(2):
                r = 8 * j + row_lane + e
                o = (r // 64) * 64 * 64 + staged_at(r % 64, col)
                out[o] = acc[4 * j + e]; out[o + 1] = acc[4 * j + 2 + e]
    assert not np.isnan(out).any()
    # TMA store boxes: (half, box) -> rows m0 + 64 half, cols n0 + 64 c + 32 box, box of 64 x 32
    for half in range(2):
        for box in range(2):
            base = half * 64 * 64 + box * 64 * 32
            for r in range(64):
                for ci in range(32):
                    C[64 * half + r, 64 * c + 32 * box + ci] = out[base + swz(r, ci)]
    # element-store path reads
    E = np.full((BM, 64), np.nan)
    for t in range(128):
        for r in range(t // 64, 128, 2):
            E[r, t % 64] = out[(r // 64) * 64 * 64 + staged_at(r % 64, t % 64)]
    assert np.allclose(E, C[:, 64 * c: 64 * c + 64])
ref = x.astype(np.float64) @ w.astype(np.float64)
assert np.allclose(C, ref, rtol=1e-5, atol=1e-5), np.abs(C - ref).max()
print("swapped path index math: OK")

# bank conflicts: fragment loads (LDS.64, half-warps of 16 lanes) and staging stores (STS.64)
def wavefronts(addrs_bytes):  # 8-byte accesses of one half warp: distinct 4-byte banks per wavefront
    banks = {}
    for a in addrs_bytes:
        for wd in (a // 4, a // 4 + 1):
            banks.setdefault(wd % 32, set()).add(wd)
    return max(len(v) for v in banks.values())
worst = 1
for c in range(2):
    for u in range(4):
        for q in range(2):
            for half in range(2):
                lanes = [32 * u + l for l in range(16 * half, 16 * half + 16)]
                ad = []
                for t in lanes:
                    col = 64 * c + swapped_col(t); box = col // 32; chunk = col % 32 // 4
                    ad.append(4 * (box * 1024 + (t % 4 + 4 * q) * 32 + ((chunk ^ (t % 4 + 4 * q)) * 4) + col % 4))
                worst = max(worst, wavefronts(ad))
print("fragment loads, worst wavefronts per half warp:", worst)
def staged_at(r, col): return (col // 32) * 64 * 32 + r * 32 + (((col % 32 // 4) ^ (r % 8)) * 4) + col % 4
worst = 1
for u in range(4):
    for j in range(16):
        for e in range(2):
            for half in range(2):
                ad = []
                for t in range(32 * u + 16 * half, 32 * u + 16 * half + 16):
                    r = 8 * j + 2 * (t % 4) + e
                    ad.append(4 * ((r // 64) * 4096 + staged_at(r % 64, swapped_col(t))))
                worst = max(worst, wavefronts(ad))
print("staging stores, worst wavefronts per half warp:", worst)
