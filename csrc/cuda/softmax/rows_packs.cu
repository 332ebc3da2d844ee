// rows_packs: the backward of rows of 1025-8192 elements (16-bit rows of whole packs, unmasked:
// 16384), one CTA a row, the row in registers.
//
// Table rows: backward, inner == 1, 16-byte accesses, frame 1025-8192 (16384), not causal-and-ragged.
// Bytes: 2 reads + 1 write an element: bf16 (16384, 4096) moves 403 MB, 96 us at 4.2 TB/s.
// Algorithm: each thread loads kPackElems (x2 past 4096 or, on fast-DRAM cards, 16-bit past 2048;
//   x4 past 8192) elements of x and of dy at once, keeps its y' in registers, and the CTA
//   (ceil(frame / elements) threads, up to 512) reduces the row's two sums once; dx in one pass.
// Why: torch.compile's shape (up to 512 threads a row, 8 elements a thread) with y recomputed;
// H200 against the shared-memory kernels, x torch.compile: fp32 (16384, 4096) 0.983 -> 1.006x,
// (131072, 1100) 0.74 -> 0.99x, bf16 (16384, 3000) 0.98 -> 1.07x (D-23).
#include "softmax.cuh"

namespace fk::softmax {
namespace {

// CTAs an SM each instance is compiled for (its register cap): 8 elements a thread 4 (16-bit) or 3
// (fp32), 16 elements 3 (16-bit) or 2 (fp32), 32 elements 2 (D-23, D-24).
template <typename T, int P> constexpr int kPackCtas = P * fk::Pack<T>::N == kPackElems ? (std::is_same_v<T, float> ? 3 : 4)
                                                     : P * fk::Pack<T>::N == 2 * kPackElems ? (std::is_same_v<T, float> ? 2 : 3)
                                                     : 2;

template <typename T, int P, bool kCausal, bool kLog, bool kRagged = false>
__global__ void __launch_bounds__(kPackThreads, (kPackCtas<T, P>))
softmax_bwd_rows_packs(int64_t n, const T *__restrict__ dy, const T *__restrict__ x,
                       const float *__restrict__ row_max, T *__restrict__ dx, float scale, int64_t causal_sq) {
    constexpr int VEC = fk::Pack<T>::N;
    __shared__ RowReduceSmem<Acc2<T>, kPackThreads / 32> red;
    fk::grid_dependency_sync();
    const int64_t row = blockIdx.x;
    const int lead = kRagged ? row_lead<VEC>(row, n) : 0;  // the row's frame (kRagged: unragged)
    const int packs = (int)(kRagged ? (lead + n + VEC - 1) / VEC : n / VEC);
    const int64_t keys = kCausal ? causal_len(row, n, causal_sq) : n;
    const int64_t dy_keys = kLog ? n : keys;  // log_softmax sums dy over masked keys too
    const T *xr = x + row * n - lead, *dyr = dy + row * n - lead;
    // pack i of this thread: threadIdx.x + i * blockDim.x; element k of it is in a length-`len`
    // prefix of the row when in(i, k, len)
    auto in = [&](int i, int k, int64_t len) {
        const int p = threadIdx.x + i * blockDim.x;
        return p < packs && (!kCausal || (int64_t)p * VEC + k < len);
    };
    fk::Pack<T> vx[P], vg[P];
#pragma unroll
    for (int i = 0; i < P; i++) {
        const int64_t at = (int64_t)(threadIdx.x + i * blockDim.x) * VEC;
        *reinterpret_cast<uint4 *>(&vx[i]) = make_uint4(0, 0, 0, 0);
        *reinterpret_cast<uint4 *>(&vg[i]) = make_uint4(0, 0, 0, 0);
        if (kRagged && row == gridDim.x - 1) {  // the tensor's last row: its last pack stops at the end
            if (in(i, 0, keys)) vx[i] = load_until<T, VEC>(xr + at, x + gridDim.x * n);
            if (in(i, 0, dy_keys)) vg[i] = load_until<T, VEC>(dyr + at, dy + gridDim.x * n);
        } else {
            if (in(i, 0, keys)) vx[i] = fk::load_pack(xr + at);
            if (in(i, 0, dy_keys)) vg[i] = fk::load_pack(dyr + at);
        }
    }
    const float ref = exp_ref(row_max[row]);
    BwdSums<T, kLog> sums;  // (z, a): sum of y', sum of dy * y' (log: of dy)
    float yv[P][VEC];
#pragma unroll
    for (int i = 0; i < P; i++) {
        auto add = [&](int k) { sums.add(yv[i][k], in(i, k, dy_keys) ? fk::pack_f32<T>(vg[i], k) : 0.f); };
#pragma unroll
        for (int k = 0; k < VEC; k++) {
            yv[i][k] = in(i, k, keys) ? exp_ftz(fmaf(fk::pack_f32<T>(vx[i], k), scale, -ref)) : 0.f;
            if (!kRagged) add(k);
        }
        if (kRagged) {
            unragged<VEC>((threadIdx.x + i * blockDim.x) * VEC, lead, lead + (int)n, [&](int k) {
                yv[i][k] = 0.f;
                vg[i].v[k] = fk::from_f32<T>(0.f);
            });
#pragma unroll
            for (int k = 0; k < VEC; k++) add(k);
        }
    }
    const Acc2<T> za = row_reduce<SumSum<Acc2<T>>>(sums.value(), red, 1);
    const BwdRow<T> br(za.x, za.y, kLog, scale);
    T *dxr = dx + row * n - lead;
#pragma unroll
    for (int i = 0; i < P; i++) {
        if (!in(i, 0, n)) continue;
        float o[VEC];
#pragma unroll
        for (int k = 0; k < VEC; k++)
            o[k] = in(i, k, keys) ? br.template dx<kLog>(yv[i][k], fk::pack_f32<T>(vg[i], k)) : 0.f;
        const int j = (threadIdx.x + i * blockDim.x) * VEC;
        if (kRagged) {
            store_in<T, VEC, true>(dxr + j, o, j, lead, lead + (int)n);
        } else {  // one conversion an element, as written before kRagged (registers: see kPackCtas)
            fk::Pack<T> out;
#pragma unroll
            for (int k = 0; k < VEC; k++) out.v[k] = fk::from_f32<T>(o[k]);
            fk::store_pack(dxr + j, out);
        }
    }
}


template <typename T> fk_status launch(const Plan &p, const BwdArgs &a, const void *kernel) {
    using Kernel = void (*)(int64_t, const T *, const T *, const float *, T *, float, int64_t);
    const fk::Launch launch(dim3((unsigned)p.grid), dim3(p.block_x), 0, a.stream, a.device);
    return launch(a.op, (Kernel)kernel, p.n, (const T *)a.dy, (const T *)a.x, a.row_max, (T *)a.dx, a.scale, p.mask_sq);
}

// The instances: dtype, packs a thread (P), causal, log, ragged.
#define BWD(T, P, CAUSAL, LOG, RAGGED)                                                          \
    {instance_key(dtype_of<T>, fk::Pack<T>::N, P, 0, CAUSAL, LOG, RAGGED),                          \
     (const void *)softmax_bwd_rows_packs<T, P, (bool)CAUSAL, (bool)LOG, (bool)RAGGED>}
const Instance kInstances[] = {
    BWD(float, 2, 0, 0, 0),
    BWD(float, 2, 0, 1, 0),
    BWD(float, 2, 1, 0, 0),
    BWD(float, 2, 1, 1, 0),
    BWD(float, 2, 0, 0, 1),
    BWD(float, 2, 0, 1, 1),
    BWD(float, 4, 0, 0, 0),
    BWD(float, 4, 0, 1, 0),
    BWD(float, 4, 1, 0, 0),
    BWD(float, 4, 1, 1, 0),
    BWD(float, 4, 0, 0, 1),
    BWD(float, 4, 0, 1, 1),
    BWD(__half, 1, 0, 0, 0),
    BWD(__half, 1, 0, 1, 0),
    BWD(__half, 1, 1, 0, 0),
    BWD(__half, 1, 1, 1, 0),
    BWD(__half, 1, 0, 0, 1),
    BWD(__half, 1, 0, 1, 1),
    BWD(__half, 2, 0, 0, 0),
    BWD(__half, 2, 0, 1, 0),
    BWD(__half, 2, 1, 0, 0),
    BWD(__half, 2, 1, 1, 0),
    BWD(__half, 2, 0, 0, 1),
    BWD(__half, 2, 0, 1, 1),
    BWD(__half, 4, 0, 0, 0),
    BWD(__half, 4, 0, 1, 0),
    BWD(__nv_bfloat16, 1, 0, 0, 0),
    BWD(__nv_bfloat16, 1, 0, 1, 0),
    BWD(__nv_bfloat16, 1, 1, 0, 0),
    BWD(__nv_bfloat16, 1, 1, 1, 0),
    BWD(__nv_bfloat16, 1, 0, 0, 1),
    BWD(__nv_bfloat16, 1, 0, 1, 1),
    BWD(__nv_bfloat16, 2, 0, 0, 0),
    BWD(__nv_bfloat16, 2, 0, 1, 0),
    BWD(__nv_bfloat16, 2, 1, 0, 0),
    BWD(__nv_bfloat16, 2, 1, 1, 0),
    BWD(__nv_bfloat16, 2, 0, 0, 1),
    BWD(__nv_bfloat16, 2, 0, 1, 1),
    BWD(__nv_bfloat16, 4, 0, 0, 0),
    BWD(__nv_bfloat16, 4, 0, 1, 0),
};
#undef BWD
}  // namespace

const void *rows_packs_kernel(const Plan &p) {
    return find_instance(kInstances, instance_key(p.dtype, p.vec, p.elems / p.vec, 0, p.masked, p.log, p.ragged));
}

fk_status launch_rows_packs(const Plan &p, const BwdArgs &a) {
    const void *kernel = rows_packs_kernel(p);
    if (!kernel) return no_instance(p, a.op);
    FK_DISPATCH_CUDA_DTYPE(p.dtype, a.op, return launch<T>(p, a, kernel));
    return FK_OK;
}

}  // namespace fk::softmax
