// GELU forward and backward on the GPU, with an optional fused bias and its fused gradient.
//
// Napkin math (H200, copy bandwidth ~4.2 TB/s read + write): forward moves 2 x bytes(x), backward
// 3 x bytes(x) (dy and x read, dx written). 2^26 bf16 elements: 256 MB -> 61 us forward, 384 MB ->
// 91 us backward. That is ~4 elements per SM per clock, ~30 fp32 instructions per element before
// the math, not the memory, sets the pace: fp32 keeps libdevice's erff / tanhf / expf (its own
// rounding must stay within 2x of torch's), fp16 / bf16 use the hardware exp2 / reciprocal for
// tanh and exp, whose ~1e-6 relative error vanishes under the 16-bit output rounding.
// Every thread moves 16-byte packs, UNROLL of them in flight; misaligned views and rows whose
// length breaks the pack fall back to one element per lane.
// The bias gradient is a column sum of dx: each block sums its rows into registers, a shared-memory
// pass folds the block's row lanes, one fp32 row of partials per block row goes to the workspace
// (P x cols, P ~ 2 waves of blocks / column tiles) and a second small kernel sums the P partials in
// a fixed order, so the result is deterministic and costs P x cols x 8 bytes, ~1% at (16384, 4096).
#include "common.cuh"

namespace {

constexpr float kSqrt1_2 = 0.70710678118654752440f;
constexpr float kInvSqrt2Pi = 0.39894228040143267794f;
constexpr float kSqrt2OverPi = 0.79788456080286535588f;
constexpr float kTanhCoef = 0.044715f;
constexpr float kLog2e = 1.44269504088896340736f;

// tanh(u) = sign(u) (1 - 2 / (exp(2|u|) + 1)), through the SFU: for 16-bit storage only.
__device__ __forceinline__ float tanh_fast(float u) {
    float e = exp2f(2.0f * kLog2e * fabsf(u));
    return copysignf(1.0f - __fdividef(2.0f, e + 1.0f), u);
}

template <bool kFast> __device__ __forceinline__ float tanh_any(float u) {
    return kFast ? tanh_fast(u) : tanhf(u);
}

template <bool kFast> __device__ __forceinline__ float exp_any(float v) {
    return kFast ? exp2f(kLog2e * v) : expf(v);
}

template <int kApprox, bool kFast> __device__ __forceinline__ float gelu(float v) {
    if (kApprox) return 0.5f * v * (1.0f + tanh_any<kFast>(kSqrt2OverPi * (v + kTanhCoef * v * v * v)));
    return 0.5f * v * (1.0f + erff(v * kSqrt1_2));
}

template <int kApprox, bool kFast> __device__ __forceinline__ float gelu_grad(float v) {
    if (kApprox) {
        float v2 = v * v;
        float t = tanh_any<kFast>(kSqrt2OverPi * (v + kTanhCoef * v2 * v));
        float du = kSqrt2OverPi * (1.0f + 3.0f * kTanhCoef * v2);
        return 0.5f * (1.0f + t) + 0.5f * v * (1.0f - t * t) * du;
    }
    return 0.5f * (1.0f + erff(v * kSqrt1_2)) + v * kInvSqrt2Pi * exp_any<kFast>(-0.5f * v * v);
}

// N consecutive elements in fp32: one 16-byte access when N fills a pack, else N scalar ones.
template <typename T, int N> struct Frag {
    float v[N];
    __device__ __forceinline__ void load(const T *p) {
        if constexpr (N == fk::Pack<T>::N) {
            fk::Pack<T> pack = fk::load_pack(p);
#pragma unroll
            for (int i = 0; i < N; i++) v[i] = fk::to_f32(pack.v[i]);
        } else {
#pragma unroll
            for (int i = 0; i < N; i++) v[i] = fk::to_f32(p[i]);
        }
    }
    __device__ __forceinline__ void store(T *p) const {
        if constexpr (N == fk::Pack<T>::N) {
            fk::Pack<T> pack;
#pragma unroll
            for (int i = 0; i < N; i++) pack.v[i] = fk::from_f32<T>(v[i]);
            fk::store_pack(p, pack);
        } else {
#pragma unroll
            for (int i = 0; i < N; i++) p[i] = fk::from_f32<T>(v[i]);
        }
    }
};

constexpr int kThreads = 256;
constexpr int kUnroll = 4;

// Forward (dy == nullptr): out = gelu(x + bias). Backward: out = dy * gelu'(x + bias).
// Each thread owns kUnroll fragments of N elements, a block's fragments contiguous per step; the
// last (count % N) elements are done by the first threads of the grid one by one.
template <typename T, int N, int kApprox, bool kBackward>
__global__ void __launch_bounds__(kThreads)
gelu_elementwise(const T *__restrict__ dy, const T *__restrict__ x, const T *__restrict__ bias,
                 T *__restrict__ out, int64_t count, int64_t cols) {
    constexpr bool kFast = sizeof(T) == 2;
    const int64_t frags = count / N;
    const int64_t first = (int64_t)blockIdx.x * kThreads * kUnroll + threadIdx.x;
    Frag<T, N> xs[kUnroll], gs[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; u++) {
        int64_t f = first + u * kThreads;
        if (f < frags) {
            xs[u].load(x + f * N);
            if (kBackward) gs[u].load(dy + f * N);
        }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; u++) {
        int64_t f = first + u * kThreads;
        if (f >= frags) continue;
        if (bias) {
            Frag<T, N> b;
            b.load(bias + (f * N) % cols);  // N divides cols whenever a bias rides on packs
#pragma unroll
            for (int i = 0; i < N; i++) xs[u].v[i] += b.v[i];
        }
#pragma unroll
        for (int i = 0; i < N; i++)
            xs[u].v[i] = kBackward ? gs[u].v[i] * gelu_grad<kApprox, kFast>(xs[u].v[i])
                                   : gelu<kApprox, kFast>(xs[u].v[i]);
        xs[u].store(out + f * N);
    }
    const int64_t tail = frags * N + (int64_t)blockIdx.x * kThreads + threadIdx.x;
    if (N > 1 && tail < count) {
        float v = fk::to_f32(x[tail]) + (bias ? fk::to_f32(bias[tail % cols]) : 0.0f);
        v = kBackward ? fk::to_f32(dy[tail]) * gelu_grad<kApprox, kFast>(v) : gelu<kApprox, kFast>(v);
        out[tail] = fk::from_f32<T>(v);
    }
}

// Backward with the bias gradient. Block = (kLanesX fragment columns) x (kLanesY rows); grid =
// (column tiles, row groups). Each thread walks rows r = group * kLanesY + y, step P * kLanesY.
constexpr int kLanesX = 32;
constexpr int kLanesY = kThreads / kLanesX;

template <typename T, int N, int kApprox>
__global__ void __launch_bounds__(kThreads)
gelu_backward_bias(const T *__restrict__ dy, const T *__restrict__ x, const T *__restrict__ bias,
                   T *__restrict__ dx, float *__restrict__ partial, int64_t rows, int64_t cols) {
    constexpr bool kFast = sizeof(T) == 2;
    __shared__ float fold[kLanesY][kLanesX * N + 1];
    const int64_t col = ((int64_t)blockIdx.x * kLanesX + threadIdx.x) * N;
    const bool active = col < cols;  // with N > 1, N divides cols
    const int64_t step = (int64_t)gridDim.y * kLanesY;
    float acc[N] = {};
    if (active) {
        Frag<T, N> b;
        b.load(bias + col);
        for (int64_t r = (int64_t)blockIdx.y * kLanesY + threadIdx.y; r < rows; r += step) {
            Frag<T, N> xv, gv;
            xv.load(x + r * cols + col);
            gv.load(dy + r * cols + col);
#pragma unroll
            for (int i = 0; i < N; i++) {
                xv.v[i] = gv.v[i] * gelu_grad<kApprox, kFast>(xv.v[i] + b.v[i]);
                acc[i] += xv.v[i];
            }
            xv.store(dx + r * cols + col);
        }
    }
#pragma unroll
    for (int i = 0; i < N; i++) fold[threadIdx.y][threadIdx.x * N + i] = acc[i];
    __syncthreads();
    // kLanesY * kLanesX threads fold kLanesX * N columns: each thread takes N / kLanesY of them
    // (or one, when N < kLanesY) and sums down the kLanesY rows in order.
    const int tid = threadIdx.y * kLanesX + threadIdx.x;
    for (int c = tid; c < kLanesX * N; c += kThreads) {
        float s = 0.0f;
#pragma unroll
        for (int y = 0; y < kLanesY; y++) s += fold[y][c];
        int64_t out_col = (int64_t)blockIdx.x * kLanesX * N + c;
        if (out_col < cols) partial[(int64_t)blockIdx.y * cols + out_col] = s;
    }
}

template <typename T>
__global__ void gelu_bias_grad_finalize(const float *__restrict__ partial, T *__restrict__ dbias,
                                        int64_t groups, int64_t cols) {
    int64_t col = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (col >= cols) return;
    float s = 0.0f;
    for (int64_t g = 0; g < groups; g++) s += partial[g * cols + col];
    dbias[col] = fk::from_f32<T>(s);
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// 16-byte packs are usable when every pointer is 16-byte aligned and, with a bias, rows keep the
// pack whole (cols a multiple of the pack).
template <typename T>
bool packs_fit(const void *a, const void *b, const void *c, const void *bias, int64_t cols) {
    constexpr int n = fk::Pack<T>::N;
    return fk::aligned16(a) && fk::aligned16(b) && fk::aligned16(c) &&
           (bias == nullptr || (fk::aligned16(bias) && cols % n == 0));
}

template <typename T, int N, bool kBackward>
void launch_elementwise(const T *dy, const T *x, const T *bias, T *out, int64_t count, int64_t cols,
                        int approximate, cudaStream_t stream) {
    int64_t blocks = ceil_div(ceil_div(count, N), (int64_t)kThreads * kUnroll);
    if (blocks == 0) blocks = 1;  // the tail alone
    if (approximate)
        gelu_elementwise<T, N, 1, kBackward><<<(unsigned)blocks, kThreads, 0, stream>>>(dy, x, bias, out, count, cols);
    else
        gelu_elementwise<T, N, 0, kBackward><<<(unsigned)blocks, kThreads, 0, stream>>>(dy, x, bias, out, count, cols);
}

template <typename T, bool kBackward>
fk_status elementwise(const T *dy, const T *x, const T *bias, T *out, int64_t rows, int64_t cols,
                      int approximate, cudaStream_t stream, const char *op) {
    int64_t count = rows * cols;
    if (count == 0) return FK_OK;
    if (ceil_div(count, (int64_t)kThreads * kUnroll) > 0x7fffffffLL)
        return fk_fail(FK_ERR_VALUE, "%s: %lld elements exceed the grid limit", op, (long long)count);
    if (packs_fit<T>(x, kBackward ? (const void *)dy : (const void *)x, out, bias, cols))
        launch_elementwise<T, fk::Pack<T>::N, kBackward>(dy, x, bias, out, count, cols, approximate, stream);
    else
        launch_elementwise<T, 1, kBackward>(dy, x, bias, out, count, cols, approximate, stream);
    return fk::launch_status(op);
}

// Row groups P of the bias-gradient kernel: about two waves of 8 blocks per SM in all.
int64_t bias_grad_groups(int64_t rows, int64_t cols, int device) {
    int64_t tiles = ceil_div(cols, (int64_t)kLanesX * 8);  // conservative N = 8 for 16-bit types
    int64_t want = ceil_div((int64_t)fk::sm_count(device) * 16, tiles);
    int64_t most = ceil_div(rows, (int64_t)kLanesY);
    int64_t groups = want < most ? want : most;
    return groups < 1 ? 1 : (groups > 65535 ? 65535 : groups);
}

template <typename T, int N, int kApprox>
void launch_backward_bias(const T *dy, const T *x, const T *bias, T *dx, T *dbias, float *partial,
                          int64_t rows, int64_t cols, int64_t groups, cudaStream_t stream) {
    dim3 grid((unsigned)ceil_div(cols, (int64_t)kLanesX * N), (unsigned)groups);
    gelu_backward_bias<T, N, kApprox><<<grid, dim3(kLanesX, kLanesY), 0, stream>>>(dy, x, bias, dx, partial, rows, cols);
    gelu_bias_grad_finalize<T><<<(unsigned)ceil_div(cols, 256), 256, 0, stream>>>(partial, dbias, groups, cols);
}

template <typename T>
fk_status backward_bias(const T *dy, const T *x, const T *bias, T *dx, T *dbias, float *partial,
                        int64_t rows, int64_t cols, int approximate, int device, cudaStream_t stream) {
    if (cols == 0) return FK_OK;
    if (ceil_div(cols, (int64_t)kLanesX) > 0x7fffffffLL)
        return fk_fail(FK_ERR_VALUE, "gelu_backward: %lld columns exceed the grid limit", (long long)cols);
    int64_t groups = bias_grad_groups(rows, cols, device);
    constexpr int n = fk::Pack<T>::N;
    bool packs = packs_fit<T>(dy, x, dx, bias, cols);
    if (packs && approximate) launch_backward_bias<T, n, 1>(dy, x, bias, dx, dbias, partial, rows, cols, groups, stream);
    else if (packs) launch_backward_bias<T, n, 0>(dy, x, bias, dx, dbias, partial, rows, cols, groups, stream);
    else if (approximate) launch_backward_bias<T, 1, 1>(dy, x, bias, dx, dbias, partial, rows, cols, groups, stream);
    else launch_backward_bias<T, 1, 0>(dy, x, bias, dx, dbias, partial, rows, cols, groups, stream);
    return fk::launch_status("gelu_backward");
}

}  // namespace

extern "C" fk_status fk_cuda_gelu_fwd(const void *x, const void *bias, void *y, int64_t rows,
                                      int64_t cols, int approximate, fk_dtype dtype, int device,
                                      void *stream) {
    FK_CUDA_ENTER("gelu", device);
    FK_DISPATCH_CUDA_DTYPE(dtype, "gelu",
        return elementwise<T, false>(nullptr, (const T *)x, (const T *)bias, (T *)y, rows, cols,
                                     approximate, (cudaStream_t)stream, "gelu"));
}

extern "C" int64_t fk_cuda_gelu_bwd_workspace(int64_t rows, int64_t cols, int device) {
    return bias_grad_groups(rows, cols, device) * cols;
}

extern "C" fk_status fk_cuda_gelu_bwd(const void *dy, const void *x, const void *bias, void *dx,
                                      void *dbias, float *workspace, int64_t rows, int64_t cols,
                                      int approximate, fk_dtype dtype, int device, void *stream) {
    FK_CUDA_ENTER("gelu_backward", device);
    if (dbias != nullptr && bias == nullptr)
        return fk_fail(FK_ERR_VALUE, "gelu_backward: dbias needs bias");
    FK_DISPATCH_CUDA_DTYPE(dtype, "gelu_backward",
        if (dbias == nullptr)
            return elementwise<T, true>((const T *)dy, (const T *)x, (const T *)bias, (T *)dx, rows,
                                        cols, approximate, (cudaStream_t)stream, "gelu_backward");
        return backward_bias<T>((const T *)dy, (const T *)x, (const T *)bias, (T *)dx, (T *)dbias,
                                workspace, rows, cols, approximate, device, (cudaStream_t)stream));
}
