// Bit packing of indices on CUDA: ppq::pack_bits / ppq::unpack_bits (TopK index streams).
//
// Design note.
// * The stream is deepspeed_ppq/compress/ops.py's: value i occupies bits [i * bits, (i + 1) * bits) of a
//   little-endian bit stream of ceil(n * bits / 8) bytes, bits in [1, 56], values taken mod 2^bits, unused
//   bits of the last byte zero. Integer work only, so the kernels are bit-exact with the CPU kernels and
//   the reference by construction.
// * Tiles of 2048 values: 2048 * bits is a multiple of 8, so a tile owns exactly 256 * bits whole bytes and
//   no two thread blocks ever write the same byte (no atomics). 256 threads per block.
// * pack: the tile's values are loaded coalesced (8 per thread, striped) into shared memory, then each
//   thread builds whole output bytes from the one to eight values that cover them and stores them;
//   consecutive threads write consecutive bytes, so the stores are coalesced too.
// * unpack: the tile's bytes are staged coalesced into shared memory (with 8 zero bytes of padding), then
//   each value is cut from the (at most 8) bytes that hold it and written as int64, coalesced.
// * Plain CUDA C++ (raw pointers and a stream) so nvcc compiles it on CPU-only CI; bitpack_binding.cpp
//   validates the tensors.
#include <cuda_runtime.h>

#include <cstdint>

#include "common.cuh"

namespace ppq_cuda {
namespace {

constexpr int kPackThreads = 256;
constexpr int kTile = 8 * kPackThreads;  // values per tile; kTile * bits / 8 = 256 * bits bytes

__global__ void __launch_bounds__(kPackThreads) pack_bits_kernel(const int64_t* __restrict__ idx, int64_t n,
                                                                 int bits, uint8_t* __restrict__ out) {
  __shared__ uint64_t vals[kTile];
  const uint64_t mask = (uint64_t(1) << bits) - 1;
  const int64_t total = (n * bits + 7) / 8;
  const int64_t tiles = (n + kTile - 1) / kTile;
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int64_t base = t * kTile;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int64_t i = base + j * kPackThreads + threadIdx.x;
      vals[j * kPackThreads + threadIdx.x] = i < n ? uint64_t(idx[i]) & mask : 0;
    }
    __syncthreads();
    const int64_t byte0 = t * kPackThreads * bits;
    const int64_t nbytes = total - byte0 < int64_t(kPackThreads) * bits ? total - byte0 : int64_t(kPackThreads) * bits;
    for (int b = threadIdx.x; b < nbytes; b += kPackThreads) {
      const int bit = 8 * b;  // first bit of this byte within the tile
      int v = bit / bits, off = bit - v * bits;
      uint64_t acc = vals[v] >> off;
      int got = bits - off;  // bits of acc that are real
      while (got < 8 && ++v < kTile) {
        acc |= vals[v] << got;
        got += bits;
      }
      out[byte0 + b] = uint8_t(acc & 255u);
    }
    __syncthreads();  // vals is refilled by the next tile
  }
}

__global__ void __launch_bounds__(kPackThreads) unpack_bits_kernel(const uint8_t* __restrict__ packed, int64_t n,
                                                                   int bits, int64_t* __restrict__ out) {
  __shared__ uint8_t buf[kPackThreads * 56 + 8];
  const uint64_t mask = (uint64_t(1) << bits) - 1;
  const int64_t total = (n * bits + 7) / 8;
  const int64_t tiles = (n + kTile - 1) / kTile;
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int64_t byte0 = t * kPackThreads * bits;
    const int64_t avail = total - byte0;
    const int nbytes = kPackThreads * bits + 8;
    for (int b = threadIdx.x; b < nbytes; b += kPackThreads) buf[b] = b < avail ? packed[byte0 + b] : 0;
    __syncthreads();
    const int64_t base = t * kTile;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int v = j * kPackThreads + threadIdx.x;
      if (base + v >= n) break;
      const int bit = v * bits, at = bit >> 3;
      uint64_t acc = 0;
#pragma unroll
      for (int q = 0; q < 8; ++q) acc |= uint64_t(buf[at + q]) << (8 * q);
      out[base + v] = int64_t((acc >> (bit & 7)) & mask);
    }
    __syncthreads();  // buf is refilled by the next tile
  }
}

}  // namespace

cudaError_t pack_bits(const int64_t* idx, int64_t n, int bits, uint8_t* out, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  pack_bits_kernel<<<common::grid_blocks(n, kTile), kPackThreads, 0, stream>>>(idx, n, bits, out);
  return cudaGetLastError();
}

cudaError_t unpack_bits(const uint8_t* packed, int64_t n, int bits, int64_t* out, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  unpack_bits_kernel<<<common::grid_blocks(n, kTile), kPackThreads, 0, stream>>>(packed, n, bits, out);
  return cudaGetLastError();
}

}  // namespace ppq_cuda
