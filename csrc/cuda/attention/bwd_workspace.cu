// The atomic backwards' workspace kernels (bwd_wgmma_sm90, bwd_atomic_mma_sm80; layout in
// attention.cuh, BwdWork): attention_bwd_prep before the main kernel, attention_bwd_dq_convert
// after it. dispatch.cu rows "bwd" whose strategy adds dQ into fp32 accumulators.
//
// Napkin math: both are memory-bound. The prep reads O and dO (2 x 2 B x d a row) and writes 8 B
// plus the zeroed dQ (4 B x cols) a row; the conversion reads the dQ (4 B x cols) and writes dq
// (2 B x d). (16, 1024, 32, 64): 64 + 134 MB and 134 + 67 MB, ~50 us each way at 4.2 TB/s (H200);
// the main kernel's 344 GFLOP take ~1 ms.
// attention_bwd_prep: cols / 8 lanes a row, 16-byte loads of O and dO where a row is 16-byte
// aligned (element loads otherwise); writes lse log2 e and D = rowsum(dO O) (+inf and 0 for padding
// rows and rows past a varlen sequence's end) and zeroes the row's dQ floats.
// attention_bwd_dq_convert: one CTA a 64 x cols tile; each thread reads float4s in accumulator
// order ((row, col), (row, col + 1), (row + 8, col), (row + 8, col + 1)) and puts the converted
// pairs into a row-major shared tile (rows padded by 16 bytes: both phases bank-conflict-free);
// the tile leaves in 16-byte row-major stores of its first d columns (direct 4-byte stores of the
// pairs: 163 us for (16, 1024, 32, 64), 41% of copy speed, H100 profile).
// Why one file: both strategies share the layout; the prep and conversion were bwd_wgmma_sm90's.
#include "attention.cuh"

namespace fk::attn {
namespace {

template <typename T, int kCols>
__global__ void __launch_bounds__(256) attention_bwd_prep(const Params p, const BwdWork ws) {
    constexpr int kLanes = kCols / 8, kRowsPerCta = 256 / kLanes;
    const int part = threadIdx.x % kLanes, c = 8 * part;
    const int64_t pad = (int64_t)ws.m_tiles * kBwdRowTile, row = (int64_t)blockIdx.x * kRowsPerCta + threadIdx.x / kLanes;
    grid_dependency_sync();
    if (row >= p.batch * p.heads * pad) return;  // whole warps: rows come in 64s
    const int i = (int)(row % pad), h = (int)(row / pad % p.heads), b = (int)(row / pad / p.heads);
    const Seq s = seq_of(p, b);
    float sum = 0.0f;
    if (i < s.sq && c < p.d) {
        const T *o = static_cast<const T *>(p.out) + seq_offset(p, b, s.q0, p.o_batch, p.o_row) + h * p.o_head +
                     (int64_t)i * p.o_row + c;
        const T *g = static_cast<const T *>(p.dout) + seq_offset(p, b, s.q0, p.do_batch, p.do_row) +
                     h * p.do_head + (int64_t)i * p.do_row + c;
        if (aligned16(o) && aligned16(g)) {
            const Pack<T> ov = load_pack(o), gv = load_pack(g);
#pragma unroll
            for (int k = 0; k < 8; k++) sum += pack_f32(ov, k) * pack_f32(gv, k);
        } else {
#pragma unroll
            for (int k = 0; k < 8; k++) sum += to_f32(o[k]) * to_f32(g[k]);  // d is a multiple of 8
        }
    }
#pragma unroll
    for (int offset = kLanes / 2; offset > 0; offset >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    float4 *dq = reinterpret_cast<float4 *>(ws.dq + row * kCols);
#pragma unroll
    for (int f = part; f < kCols / 4; f += kLanes) dq[f] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (part == 0) {
        ws.dvec[row] = sum;
        ws.lse2[row] = i < s.sq ? p.lse[lse_index(p, s, b, h, i)] * kLog2e : INFINITY;
    }
}

// dq: dense (batch | total, sq, heads, d) rows (a fresh tensor) = scale x the workspace's dQ.
template <typename T, int kCols>
__global__ void __launch_bounds__(256) attention_bwd_dq_convert(const Params p, const BwdWork ws) {
    constexpr int kRow = kCols + 8;  // elements a shared row
    __shared__ alignas(16) T out[kBwdRowTile * kRow];
    grid_dependency_sync();
    const int64_t job = blockIdx.x, bh = job / ws.m_tiles;
    const int tile = (int)(job % ws.m_tiles), h = (int)(bh % p.heads), b = (int)(bh / p.heads);
    const Seq s = seq_of(p, b);
    const int rows = min(kBwdRowTile, s.sq - tile * kBwdRowTile), d = (int)p.d;
    if (rows <= 0) return;  // a padding tile (sq rounded up to the query step), or past a varlen end
    const float4 *src = reinterpret_cast<const float4 *>(ws.dq + job * kBwdRowTile * kCols);
#pragma unroll
    for (int f = threadIdx.x; f < kBwdRowTile * kCols / 4; f += 256) {
        const float4 v = src[f];
        const int t = f % 128, row = 16 * (t / 32) + (t % 32) / 4;
        const int col = 64 * (f / 1024) + 8 * (f / 128 % 8) + 2 * (t % 4);
        *reinterpret_cast<uint32_t *>(out + row * kRow + col) = pack2<T>(v.x * p.scale, v.y * p.scale);
        *reinterpret_cast<uint32_t *>(out + (row + 8) * kRow + col) = pack2<T>(v.z * p.scale, v.w * p.scale);
    }
    __syncthreads();
    const int64_t row_stride = p.heads * p.d;
    T *dst = static_cast<T *>(p.dq) + (s.q0 + (int64_t)tile * kBwdRowTile) * row_stride + (int64_t)h * d;
    const bool wide = aligned16(p.dq);  // d is a multiple of 8: every row 16-byte aligned with the base
#pragma unroll
    for (int c = threadIdx.x; c < kBwdRowTile * kCols / 8; c += 256) {
        const int row = c / (kCols / 8), col = 8 * (c % (kCols / 8));
        if (row >= rows || col >= d) continue;
        if (wide) {
            *reinterpret_cast<uint4 *>(dst + row * row_stride + col) =
                *reinterpret_cast<const uint4 *>(out + row * kRow + col);
        } else {
#pragma unroll
            for (int e = 0; e < 8; e++) dst[row * row_stride + col + e] = out[row * kRow + col + e];
        }
    }
}

template <typename T, int kCols>
fk_status prep(const BwdWork &ws, const Params &p, int device, cudaStream_t stream) {
    constexpr int kRowsPerCta = 256 / (kCols / 8);
    const int64_t rows = p.batch * p.heads * ws.m_tiles * kBwdRowTile;
    if (rows == 0) return FK_OK;
    return Launch(dim3((unsigned)((rows + kRowsPerCta - 1) / kRowsPerCta)), dim3(256), 0, stream, device)(
        "attention_bwd_prep", attention_bwd_prep<T, kCols>, p, ws);
}

template <typename T, int kCols>
fk_status convert(const BwdWork &ws, const Params &p, int device, cudaStream_t stream) {
    const int64_t tiles = p.batch * p.heads * ws.m_tiles;
    if (tiles == 0) return FK_OK;
    return Launch(dim3((unsigned)tiles), dim3(256), 0, stream, device)(
        "attention_bwd_dq_convert", attention_bwd_dq_convert<T, kCols>, p, ws);
}

}  // namespace

// Instances: attention_bwd_prep and attention_bwd_dq_convert, each x {__half, __nv_bfloat16} x
// cols {64, 128} = 8.
fk_status launch_bwd_prep(const BwdWork &ws, int cols, const Params &p, fk_dtype dtype, int device,
                          cudaStream_t stream) {
    if (dtype == FK_BFLOAT16)
        return cols == 64 ? prep<__nv_bfloat16, 64>(ws, p, device, stream) : prep<__nv_bfloat16, 128>(ws, p, device, stream);
    return cols == 64 ? prep<__half, 64>(ws, p, device, stream) : prep<__half, 128>(ws, p, device, stream);
}

fk_status launch_bwd_dq_convert(const BwdWork &ws, int cols, const Params &p, fk_dtype dtype, int device,
                                cudaStream_t stream) {
    if (dtype == FK_BFLOAT16)
        return cols == 64 ? convert<__nv_bfloat16, 64>(ws, p, device, stream)
                          : convert<__nv_bfloat16, 128>(ws, p, device, stream);
    return cols == 64 ? convert<__half, 64>(ws, p, device, stream) : convert<__half, 128>(ws, p, device, stream);
}

}  // namespace fk::attn
