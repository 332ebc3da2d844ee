// GELU forward and backward on the GPU, with an optional fused bias and its fused gradient.
//
// Napkin math (H200, copy bandwidth ~4.26 TB/s read + write): forward moves 2 x bytes(x), backward
// 3 x bytes(x) (dy and x read, dx written). 2^26 bf16 elements: 256 MB -> 60 us forward, 384 MB ->
// 90 us backward: ~4 elements per SM per clock, so with 16-bit storage the instruction count, not
// the memory, can set the pace. The tanh form is computed as x * sigmoid(2u) = x / (1 + exp(-2u)):
// one exp and one division, no cancellation in 1 + tanh(u) for negative x. fp32 keeps libdevice's
// accurate expf / erff and correctly rounded division (its rounding must stay within 2x of
// torch's); fp16 / bf16 use bare MUFU ex2 / rcp (ftz, no fix-up code) with the constants folded:
// ~8 instructions an element for the tanh form (bf16 forward 94% of copy on an H200, against 91%
// with exp2f / __fdividef; 96-97% with the 128-thread blocks below). The erf form's erff costs ~25
// instructions an element: bf16 erf forward stays ALU-bound (75%).
//
// Two kernel shapes, both moving 16-byte packs (plain loads: the read-only path measured slower),
// with kUnroll packs in flight per thread and tensor (one element per lane where a view is
// misaligned or a row breaks the pack), and both ordered so that blocks running together touch
// neighbouring memory:
//  - gelu_flat: the tensor as one flat array (no bias, or a bias on rows narrower than a warp's
//    worth of packs, found by a 64-bit modulo per fragment);
//  - gelu_rows: blocks own a column tile and stride over row blocks, so each thread keeps its
//    bias fragment in registers and, in backward, sums its column of dx. A shared-memory pass folds
//    the block's row lanes into one fp32 row of partials per row group (P x cols in the workspace,
//    P ~ 2 waves of resident blocks / column tiles); a second small kernel sums the P partials in a fixed
//    order: deterministic, and P x cols x 8 bytes, ~1% of the traffic at (16384, 4096).
// Backward's optional second output y = gelu(x + bias) (FusedMLP's backward: dW2 needs gelu(h), dh
// needs gelu'(h)) rides in the same pass: 4 x bytes(x) (512 MB at 2^26 bf16, 120 us) against 3 + 2
// for a backward and a separate forward (640 MB, 150 us), and one launch fewer. gelu(v) is the
// forward's expression on the same fp32 v (bit for bit the forward's result) and shares gelu'(v)'s
// exp and reciprocal (tanh, merged by the compiler) or erff (erf, fk::gelu_grad_value): ~2-3
// instructions more an element. A null y only skips its store (a uniform branch; the compiler
// unswitches the row loop on it): no extra kernel instances (D-131, not yet measured on a GPU).
#include <type_traits>

#include "common.cuh"
#include "gelu_math.cuh"

namespace {

using fk::gelu;
using fk::gelu_grad_value;

// N consecutive elements kept in their storage type (half the registers of fp32 for 16-bit
// types): one 16-byte access when N fills a pack, else N scalar ones.
template <typename T, int N> struct alignas(N == fk::Pack<T>::N ? 16 : alignof(T)) Frag {
    T v[N];
    __device__ __forceinline__ void load(const T *p) {
        if constexpr (N == fk::Pack<T>::N) {
            *reinterpret_cast<fk::Pack<T> *>(v) = fk::load_pack(p);
        } else {
#pragma unroll
            for (int i = 0; i < N; i++) v[i] = p[i];
        }
    }
    __device__ __forceinline__ void store(T *p) const {
        if constexpr (N == fk::Pack<T>::N) {
            fk::store_pack(p, *reinterpret_cast<const fk::Pack<T> *>(v));
        } else {
#pragma unroll
            for (int i = 0; i < N; i++) p[i] = v[i];
        }
    }
};

constexpr int kRowThreads = 256;  // threads per gelu_rows block
constexpr int kLanesX = 32;  // gelu_rows: fragment columns per block
constexpr int kLanesY = kRowThreads / kLanesX;

// Fragments in flight per thread and tensor, measured on an H200 (2^26 elements, 16384 x 4096):
// two for the flat kernel (one left the fp32 and erf forwards 1-6 points lower), one forward and
// two backward for the row tiles. Persistent grid-stride forms of both (one wave of resident
// blocks, with or without the next step's loads issued before this step's math) lost 5-15 points.
template <bool kRows, bool kBackward> constexpr int kUnroll = kRows && !kBackward ? 1 : 2;
// Threads per block of the flat kernel: 128 forward (H200, 2^26 elements: fp32 98% of copy against
// 96% with 256, bf16 tanh 96.5% against 95%; 512 lost 1-4 points), 256 backward (100-102%).
template <bool kBackward> constexpr int kFlatThreads = kBackward ? 256 : 128;

// x <- gelu(x + bias) (forward) or dy * gelu'(x + bias) (backward), in place; returns the fp32
// results through `sum` (added) for the bias gradient. Backward with y (not null) also stores
// gelu(x + bias) at y + at: the forward's expression, sharing gelu'(v)'s exp / rcp / erff.
template <int kApprox, bool kBackward, typename T, int N>
__device__ __forceinline__ void apply(Frag<T, N> &x, const Frag<T, N> &dy, const float (&bias)[N],
                                      float (&sum)[N], T *__restrict__ y, int64_t at) {
    constexpr bool kFast = sizeof(T) == 2;
    Frag<T, N> act;
#pragma unroll
    for (int i = 0; i < N; i++) {
        const float v = fk::to_f32(x.v[i]) + bias[i];
        float a, out;
        if constexpr (kBackward) out = fk::to_f32(dy.v[i]) * gelu_grad_value<kApprox, kFast>(v, a);
        else out = a = gelu<kApprox, kFast>(v);
        act.v[i] = fk::from_f32<T>(a);
        sum[i] += out;
        x.v[i] = fk::from_f32<T>(out);
    }
    if (kBackward && y != nullptr) act.store(y + at);
}

template <typename T, int N> __device__ __forceinline__ void load_f32(const T *p, float (&out)[N]) {
    Frag<T, N> f;
    f.load(p);
#pragma unroll
    for (int i = 0; i < N; i++) out[i] = fk::to_f32(f.v[i]);
}

// Forward (kBackward false): out = gelu(x + bias). Backward: out = dy * gelu'(x + bias), and
// y = gelu(x + bias) where y is not null.
// Block b owns fragments [b * kThreads * kU, (b + 1) * kThreads * kU): blocks running together
// touch neighbouring memory. The last count % N elements (when N > 1) go one per thread to the
// first threads of the grid.
template <typename T, int N, int kApprox, bool kBackward>
__global__ void __launch_bounds__(kFlatThreads<kBackward>)
gelu_flat(const T *__restrict__ dy, const T *__restrict__ x, const T *__restrict__ bias,
          T *__restrict__ out, T *__restrict__ y, float *__restrict__, int64_t rows, int64_t cols) {
    fk::grid_dependency_sync();
    constexpr int kU = kUnroll<false, kBackward>, kThreads = kFlatThreads<kBackward>;
    const int64_t count = rows * cols, frags = count / N;
    const int64_t base = (int64_t)blockIdx.x * kThreads * kU + threadIdx.x;
    Frag<T, N> xs[kU], gs[kU];
#pragma unroll
    for (int u = 0; u < kU; u++) {
        const int64_t f = base + u * kThreads;
        if (f < frags) {
            xs[u].load(x + f * N);
            if (kBackward) gs[u].load(dy + f * N);
        }
    }
    float unused[N];
#pragma unroll
    for (int u = 0; u < kU; u++) {
        const int64_t f = base + u * kThreads;
        if (f >= frags) continue;
        float b[N] = {};
        if (bias) load_f32<T, N>(bias + (f * N) % cols, b);  // N divides cols with packs
        apply<kApprox, kBackward>(xs[u], gs[u], b, unused, y, f * N);
        xs[u].store(out + f * N);
    }
    const int64_t tail = frags * N + (int64_t)blockIdx.x * kThreads + threadIdx.x;
    if (N > 1 && tail < count) {
        Frag<T, 1> v, g;
        v.load(x + tail);
        if (kBackward) g.load(dy + tail);
        float b[1] = {bias ? fk::to_f32(bias[tail % cols]) : 0.0f}, sum[1];
        apply<kApprox, kBackward>(v, g, b, sum, y, tail);
        v.store(out + tail);
    }
}

// Row-tiled form for a bias: block (kLanesX fragment columns) x (kLanesY row lanes); grid = (column
// tiles, row groups). Group g takes row blocks of kLanesY * kU rows g, g + groups, ... so groups
// running together touch neighbouring rows. With kBiasGrad, each thread sums its column of dx and
// the block writes one row of fp32 partials for its group.
template <typename T, int N, int kApprox, bool kBackward, bool kBiasGrad>
__global__ void __launch_bounds__(kRowThreads)
gelu_rows(const T *__restrict__ dy, const T *__restrict__ x, const T *__restrict__ bias,
          T *__restrict__ out, T *__restrict__ y, float *__restrict__ partial, int64_t rows,
          int64_t cols) {
    fk::grid_dependency_sync();
    constexpr int kU = kUnroll<true, kBackward>;
    const int64_t col = ((int64_t)blockIdx.x * kLanesX + threadIdx.x) * N;
    float acc[N] = {};
    if (col < cols) {  // with N > 1, N divides cols
        float b[N];
        load_f32<T, N>(bias + col, b);
        for (int64_t base = ((int64_t)blockIdx.y * kU) * kLanesY + threadIdx.y; base < rows;
             base += (int64_t)gridDim.y * kU * kLanesY) {
            Frag<T, N> xs[kU], gs[kU];
#pragma unroll
            for (int u = 0; u < kU; u++) {
                const int64_t r = base + u * kLanesY;
                if (r < rows) {
                    xs[u].load(x + r * cols + col);
                    if (kBackward) gs[u].load(dy + r * cols + col);
                }
            }
#pragma unroll
            for (int u = 0; u < kU; u++) {
                const int64_t r = base + u * kLanesY;
                if (r >= rows) continue;
                apply<kApprox, kBackward>(xs[u], gs[u], b, acc, y, r * cols + col);
                xs[u].store(out + r * cols + col);
            }
        }
    }
    if constexpr (kBiasGrad) {
        __shared__ float fold[kLanesY][kLanesX * N + 1];
#pragma unroll
        for (int i = 0; i < N; i++) fold[threadIdx.y][threadIdx.x * N + i] = acc[i];
        __syncthreads();
        // the block's threads fold its kLanesX * N columns down the kLanesY rows, in order
        for (int c = threadIdx.y * kLanesX + threadIdx.x; c < kLanesX * N; c += kRowThreads) {
            float s = 0.0f;
#pragma unroll
            for (int y = 0; y < kLanesY; y++) s += fold[y][c];
            int64_t out_col = (int64_t)blockIdx.x * kLanesX * N + c;
            if (out_col < cols) partial[(int64_t)blockIdx.y * cols + out_col] = s;
        }
    }
}

template <typename T>
__global__ void gelu_bias_grad_finalize(const float *__restrict__ partial, T *__restrict__ dbias,
                                        int64_t groups, int64_t cols) {
    fk::grid_dependency_sync();
    int64_t col = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (col >= cols) return;
    float s = 0.0f;
    for (int64_t g = 0; g < groups; g++) s += partial[g * cols + col];
    dbias[col] = fk::from_f32<T>(s);
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Blocks of `kernel` resident on one SM times the SM count, read once per kernel.
template <auto kernel> int64_t resident_blocks(int device) {
    static int per_sm = 0;
    if (per_sm == 0) {
        int n = 0;
        if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, kRowThreads, 0) != cudaSuccess || n < 1) {
            cudaGetLastError();
            n = 1;
        }
        per_sm = n;
    }
    return (int64_t)per_sm * fk::sm_count(device);
}

// How a call runs: kernel shape and grid, computed identically for the workspace query and the
// launch, so the workspace always matches the row groups.
struct Plan {
    bool packs;   // 16-byte packs (else one element per lane)
    bool rows;    // gelu_rows (else gelu_flat)
    bool backward, bias_grad;
    int approx, threads;  // threads per block
    int64_t tiles, groups;
};

// Calls f(std::integral_constant holding the kernel the plan names); all kernels share one
// signature (dy, x, bias, out, y, partial, rows, cols).
#define FK_KERNEL(...) std::integral_constant<decltype(&__VA_ARGS__), &__VA_ARGS__>()
template <typename T, int N, int kApprox, typename F> auto with_kernel_n(const Plan &p, F &&f) {
    if (!p.rows) {
        if (p.backward) return f(FK_KERNEL(gelu_flat<T, N, kApprox, true>));
        return f(FK_KERNEL(gelu_flat<T, N, kApprox, false>));
    }
    if (p.bias_grad) return f(FK_KERNEL(gelu_rows<T, N, kApprox, true, true>));
    if (p.backward) return f(FK_KERNEL(gelu_rows<T, N, kApprox, true, false>));
    return f(FK_KERNEL(gelu_rows<T, N, kApprox, false, false>));
}
#undef FK_KERNEL

template <typename T, typename F> auto with_kernel(const Plan &p, F &&f) {
    constexpr int n = fk::Pack<T>::N;
    if (p.packs) return p.approx ? with_kernel_n<T, n, 1>(p, f) : with_kernel_n<T, n, 0>(p, f);
    return p.approx ? with_kernel_n<T, 1, 1>(p, f) : with_kernel_n<T, 1, 0>(p, f);
}

template <typename T>
Plan make_plan(const void *a, const void *b, const void *c, const void *d, const void *bias,
               bool bias_grad, int64_t rows, int64_t cols, int approximate, bool backward, int device) {
    constexpr int n = fk::Pack<T>::N;
    Plan p{};
    p.packs = fk::aligned16(a) && fk::aligned16(b) && fk::aligned16(c) && fk::aligned16(d) &&
              (bias == nullptr || (fk::aligned16(bias) && cols % n == 0));
    const int N = p.packs ? n : 1;
    // a bias rides on row tiles when a warp's worth of fragments fills a row, or when its gradient
    // is wanted; otherwise on the flat kernel
    p.rows = bias_grad || (bias != nullptr && cols >= kLanesX * N);
    p.backward = backward;
    p.bias_grad = bias_grad;
    p.approx = approximate;
    const int64_t count = rows * cols;
    if (p.rows) {
        // row groups: two waves of resident blocks over the column tiles, fewer when rows run out
        p.tiles = ceil_div(cols, (int64_t)kLanesX * N);
        const int64_t resident = with_kernel<T>(p, [&](auto kernel) {
            return resident_blocks<decltype(kernel)::value>(device);
        });
        const int64_t unroll = backward ? kUnroll<true, true> : kUnroll<true, false>;
        const int64_t groups = min(max(2 * resident / p.tiles, (int64_t)1), ceil_div(rows, kLanesY * unroll));
        p.groups = max(min(groups, (int64_t)65535), (int64_t)1);
    } else {
        const int64_t unroll = backward ? kUnroll<false, true> : kUnroll<false, false>;
        p.threads = backward ? kFlatThreads<true> : kFlatThreads<false>;
        p.groups = max(ceil_div(count / N, p.threads * unroll),
                       ceil_div(count % N, (int64_t)p.threads));  // enough threads for the tail
    }
    return p;
}

template <typename T>
fk_status run(const T *dy, const T *x, const T *bias, T *out, T *y, T *dbias, float *partial,
              int64_t rows, int64_t cols, int approximate, bool backward, int device,
              cudaStream_t stream, const char *op) {
    if (rows * cols == 0) return FK_OK;
    if (ceil_div(rows * cols, (int64_t)kFlatThreads<false>) > 0x7fffffffLL)
        return fk_fail(FK_ERR_VALUE, "%s: %lld elements exceed the grid limit", op, (long long)(rows * cols));
    const Plan p = make_plan<T>(x, backward ? (const void *)dy : (const void *)x, out, y, bias,
                                dbias != nullptr, rows, cols, approximate, backward, device);
    const fk_status status = with_kernel<T>(p, [&](auto kernel) {
        const dim3 grid = p.rows ? dim3((unsigned)p.tiles, (unsigned)p.groups) : dim3((unsigned)p.groups);
        const dim3 block = p.rows ? dim3(kLanesX, kLanesY) : dim3(p.threads);
        return fk::Launch(grid, block, 0, stream, device)(op, decltype(kernel)::value, dy, x, bias,
                                                          out, y, partial, rows, cols);
    });
    if (status != FK_OK || !dbias) return status;
    return fk::Launch(dim3((unsigned)ceil_div(cols, 256)), dim3(256), 0, stream, device)(
        op, gelu_bias_grad_finalize<T>, (const float *)partial, dbias, p.groups, cols);
}

}  // namespace

extern "C" fk_status fk_cuda_gelu_fwd(const void *x, const void *bias, void *y, int64_t rows,
                                      int64_t cols, int approximate, fk_dtype dtype, int device,
                                      void *stream) {
    FK_CUDA_ENTER("gelu", device);
    FK_DISPATCH_CUDA_DTYPE(dtype, "gelu",
        return run<T>(nullptr, (const T *)x, (const T *)bias, (T *)y, nullptr, nullptr, nullptr,
                      rows, cols, approximate, false, device, (cudaStream_t)stream, "gelu"));
}

extern "C" int64_t fk_cuda_gelu_bwd_workspace(const void *dy, const void *x, const void *bias,
                                              const void *dx, const void *y, int64_t rows,
                                              int64_t cols, int approximate, fk_dtype dtype,
                                              int device) {
    fk::DeviceGuard guard(device);
    int64_t groups = 0;
    switch (dtype) {
    case FK_FLOAT32: groups = make_plan<float>(x, dy, dx, y, bias, true, rows, cols, approximate, true, device).groups; break;
    case FK_FLOAT16: groups = make_plan<__half>(x, dy, dx, y, bias, true, rows, cols, approximate, true, device).groups; break;
    case FK_BFLOAT16: groups = make_plan<__nv_bfloat16>(x, dy, dx, y, bias, true, rows, cols, approximate, true, device).groups; break;
    default: break;
    }
    return groups * cols;
}

extern "C" fk_status fk_cuda_gelu_bwd(const void *dy, const void *x, const void *bias, void *dx,
                                      void *dbias, void *y, float *workspace, int64_t rows,
                                      int64_t cols, int approximate, fk_dtype dtype, int device,
                                      void *stream) {
    FK_CUDA_ENTER("gelu_backward", device);
    if (dbias != nullptr && (bias == nullptr || workspace == nullptr))
        return fk_fail(FK_ERR_VALUE, "gelu_backward: a bias gradient needs bias and a workspace");
    FK_DISPATCH_CUDA_DTYPE(dtype, "gelu_backward",
        return run<T>((const T *)dy, (const T *)x, (const T *)bias, (T *)dx, (T *)y, (T *)dbias,
                      workspace, rows, cols, approximate, true, device, (cudaStream_t)stream,
                      "gelu_backward"));
}
