// Adam/AdamW with blockwise 8-bit states (bitsandbytes' layout) on CUDA: ppq::adam8bit_blockwise_step_.
//
// Design note.
// * The math is deepspeed_ppq/quant/adam8bit.py's, operation for operation in fp32, as csrc/cpu/adam8bit.h
//   does it (same order; the _rn intrinsics so nvcc cannot fuse a product into an FMA; IEEE square root
//   and division): states decoded through the 256-entry maps and the block absmax, the Adam update in
//   bitsandbytes' CUDA form p + step_size * (m / (sqrt(v) + eps * c2)) with decoupled weight decay, the
//   new absmax, and the states re-encoded to the nearest code of m * (1 / absmax) = the number of code
//   midpoints below it (a tie goes to the lower code). The host-side scalars (step size, eps * c2) are
//   computed in double exactly as the CPU kernel's make_hyper computes them. So the parameters, absmax
//   and codes equal the CPU kernel's (and the reference's) bit for bit.
// * One thread per value and one 256-thread block per optimizer block of 256 values: the block's absmax is
//   a warp-shuffle + shared-memory max of the magnitudes' bits (a NaN moment gives a NaN absmax, as the
//   reference's amax and the CPU kernel). A grid of
//   at most kMaxBlocks blocks strides over the optimizer blocks, so each thread block prepares the two code
//   maps once and reuses them.
// * Nearest code: the 255 midpoints of each map sit in shared memory sorted (each placed at its rank, so
//   any map is counted exactly) in Eytzinger (breadth-first) order, and the search is 8 branch-free steps
//   i = 2i + 1 + (mid[i] < y), which ends at 255 + (midpoints below y). The first levels are read by all
//   threads from a few words (broadcasts); level l spans 2^l consecutive words, so bank conflicts stay at
//   most 4-way. (The CPU kernel's cell table, 192 KiB per map, would not fit in shared memory.) A NaN
//   state value of either sign is searched as +Inf: code 255, as the reference's bucketize.
// * Plain CUDA C++ (raw pointers and a stream) so nvcc compiles it on CPU-only CI; adam8bit_binding.cpp
//   validates the tensors.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "common.cuh"

namespace ppq_cuda {
namespace {

constexpr int kBlock = 256;        // values per absmax (bitsandbytes' blockwise optimizers) = threads
constexpr int kMaxBlocks = 2048;   // thread blocks of the grid-stride loop

struct Scalars {  // the update's fp32 constants, as the CPU kernel's make_hyper rounds them
  float b1, b2, ob1, ob2;  // beta1, beta2, 1 - beta1, 1 - beta2
  float eps2;              // eps * sqrt(1 - beta2^t)
  float step_size;         // -lr * sqrt(1 - beta2^t) / (1 - beta1^t)
  float gs, decay;         // gnorm_scale, 1 - lr * weight_decay
  bool wd, scale_g;        // weight_decay > 0, gnorm_scale != 1
};

// Position of sorted midpoint j (0..254) in the breadth-first layout of a complete tree of 255 keys.
__device__ __forceinline__ int eytzinger(int j) {
  const int v = j + 1, tz = __ffs(v) - 1;  // in-order rank (1-based) and its trailing zeros
  return (1 << (7 - tz)) - 1 + (v >> (tz + 1));
}

// Number of midpoints below y (0..255); a NaN of either sign: 255, as the reference's bucketize.
__device__ __forceinline__ uint8_t nearest(const float* tree, float y) {
  if (y != y) y = INFINITY;
  int i = 0;
#pragma unroll
  for (int l = 0; l < 8; ++l) i = 2 * i + 1 + (tree[i] < y ? 1 : 0);
  return uint8_t(i - 255);
}

__global__ void __launch_bounds__(kBlock)
    adam8bit_kernel(float* __restrict__ p, const float* __restrict__ g, uint8_t* __restrict__ state1,
                    uint8_t* __restrict__ state2, float* __restrict__ absmax1, float* __restrict__ absmax2,
                    const float* __restrict__ qmap1, const float* __restrict__ qmap2, int64_t n, int64_t nb,
                    Scalars k) {
  __shared__ float val1[256], val2[256], tree1[256], tree2[256], mid1[256], mid2[256];
  __shared__ unsigned red1[kBlock / 32], red2[kBlock / 32];
  const int t = threadIdx.x;
  val1[t] = qmap1[t];
  val2[t] = qmap2[t];
  __syncthreads();
  if (t < 255) {
    mid1[t] = __fdiv_rn(__fadd_rn(val1[t], val1[t + 1]), 2.0f);
    mid2[t] = __fdiv_rn(__fadd_rn(val2[t], val2[t + 1]), 2.0f);
  }
  __syncthreads();
  if (t < 255) {  // midpoint t at its rank among the 255 (ties by index), in breadth-first order
    const float x1 = mid1[t], x2 = mid2[t];
    int r1 = 0, r2 = 0;
    for (int j = 0; j < 255; ++j) {
      r1 += mid1[j] < x1 || (mid1[j] == x1 && j < t);
      r2 += mid2[j] < x2 || (mid2[j] == x2 && j < t);
    }
    tree1[eytzinger(r1)] = x1;
    tree2[eytzinger(r2)] = x2;
  }
  __syncthreads();
  for (int64_t b = blockIdx.x; b < nb; b += gridDim.x) {
    const int64_t i = b * kBlock + t;
    const bool ok = i < n;
    const float a1 = absmax1[b], a2 = absmax2[b];
    float v1 = 0.0f, v2 = 0.0f;
    if (ok) {
      const float gi = k.scale_g ? __fmul_rn(g[i], k.gs) : g[i];
      v1 = __fadd_rn(__fmul_rn(__fmul_rn(val1[state1[i]], a1), k.b1), __fmul_rn(gi, k.ob1));
      v2 = __fadd_rn(__fmul_rn(__fmul_rn(val2[state2[i]], a2), k.b2), __fmul_rn(__fmul_rn(gi, gi), k.ob2));
      float w = p[i];
      if (k.wd) w = __fmul_rn(w, k.decay);
      const float denom = __fadd_rn(__fsqrt_rn(v2), k.eps2);
      p[i] = __fadd_rn(w, __fmul_rn(k.step_size, __fdiv_rn(v1, denom)));
    }
    // block max of |v1| and of v2 (>= 0 or NaN) as the magnitudes' bits: the integer order is the float
    // order with NaN above +Inf, so a NaN moment makes the absmax NaN (the reference's amax, the CPU kernel)
    unsigned m1 = __float_as_uint(fabsf(v1)), m2 = __float_as_uint(fabsf(v2));
    for (int o = 16; o > 0; o >>= 1) {
      m1 = max(m1, __shfl_xor_sync(0xffffffffu, m1, o));
      m2 = max(m2, __shfl_xor_sync(0xffffffffu, m2, o));
    }
    __syncthreads();  // red1/red2 may still be read for the previous optimizer block
    if ((t & 31) == 0) {
      red1[t >> 5] = m1;
      red2[t >> 5] = m2;
    }
    __syncthreads();
#pragma unroll
    for (int w = 0; w < kBlock / 32; ++w) {
      m1 = max(m1, red1[w]);
      m2 = max(m2, red2[w]);
    }
    const float mx1 = __uint_as_float(m1), mx2 = __uint_as_float(m2);
    if (t == 0) {  // every thread has read a1/a2 (before the barriers above)
      absmax1[b] = mx1;
      absmax2[b] = mx2;
    }
    if (ok) {
      // the block's reciprocals (all-zero block and NaN absmax: 1, as the reference's where(a > 0, a, 1))
      const float r1 = __fdiv_rn(1.0f, mx1 > 0.0f ? mx1 : 1.0f), r2 = __fdiv_rn(1.0f, mx2 > 0.0f ? mx2 : 1.0f);
      state1[i] = nearest(tree1, __fmul_rn(v1, r1));
      state2[i] = nearest(tree2, __fmul_rn(v2, r2));
    }
  }
}

}  // namespace

cudaError_t adam8bit_blockwise_step(float* p, const float* g, uint8_t* state1, uint8_t* state2, float* absmax1,
                                    float* absmax2, const float* qmap1, const float* qmap2, int64_t n,
                                    double beta1, double beta2, double eps, int64_t step, double lr,
                                    double weight_decay, double gnorm_scale, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  // as csrc/cpu/adam8bit.h's make_hyper rounds them
  const double c1 = 1.0 - std::pow(beta1, double(step)), c2 = std::sqrt(1.0 - std::pow(beta2, double(step)));
  Scalars k;
  k.b1 = float(beta1);
  k.b2 = float(beta2);
  k.ob1 = float(1.0 - beta1);
  k.ob2 = float(1.0 - beta2);
  k.eps2 = float(eps * c2);
  k.step_size = float((-lr * c2) / c1);
  k.gs = float(gnorm_scale);
  k.decay = float(1.0 - lr * weight_decay);
  k.wd = weight_decay > 0.0;
  k.scale_g = k.gs != 1.0f;
  const int64_t nb = (n + kBlock - 1) / kBlock;
  adam8bit_kernel<<<common::grid_blocks(nb, 1, kMaxBlocks), kBlock, 0, stream>>>(p, g, state1, state2, absmax1,
                                                                                 absmax2, qmap1, qmap2, n, nb, k);
  return cudaGetLastError();
}

}  // namespace ppq_cuda
