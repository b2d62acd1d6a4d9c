// TopK per row on CUDA: ppq::topk_encode (the k largest |x| of each row, exactly the reference's indices)
// and ppq::topk_decode (zero + scatter back), fp32 / bf16 / fp16.
//
// Design note.
// * Exact selection = exact k-th largest key. The key of a value is the bits of |float(x)| (sign cleared):
//   non-negative floats order like their bits, and NaN lands above Inf, as in the CPU kernel. A radix select
//   on the 31-bit key in three digits (11 + 11 + 9 bits) finds the k-th largest key T and how many values
//   equal to T are taken ("ties" = k - #(key > T)); the output is every key > T plus the first `ties` keys
//   == T in index order, written in ascending index order. That is the reference's choice (a stable
//   descending sort: ties to the lower index) and the CPU kernel's, index for index.
// * Long rows (L >= 2^16; rows are few and long: a sample's activation) are split over many thread blocks
//   and x is read once:
//     1. bound (one block per row): a sample of 64 x 256 keys spread over the row gives a bound `lo` that
//        somewhat more than k values should clear (the CPU kernel's rule: k's share of the sample plus ~4
//        standard deviations and 10%);
//     2. compact (tiles of 4096 values, many blocks per row): the values with key >= lo are written, in
//        index order, as (index, raw bits) candidates, with a histogram of their first digit. Index order
//        across tiles comes from a single-pass scan with decoupled look-back: a block takes the next tile
//        of its row from an atomic counter (so every earlier tile's block is already running), publishes
//        its count, and a warp looks back over its predecessors' published counts / inclusive prefixes;
//     3. digits 2 and 3 are histogrammed over the candidates only (a few percent of x); the last block of
//        each histogram pass (a done counter) picks the digit;
//     4. select: the candidates are scanned once more with the same look-back, now counting (key > T,
//        key == T) pairs, and each taken one is written at (greater before) + min(equal before, ties).
//   A row whose sample misled the bound (fewer than k candidates, or more than the candidate buffer holds:
//   3k + 8192, e.g. a constant row) is marked failed and redone by the one-block kernel below; the fast
//   kernels skip it. Memory: 8 bytes per candidate slot plus small per-row state.
// * Short rows (L < 2^16), and failed rows: one 512-thread block per row runs the same three histogram
//   rounds and the ordered write over the row itself, with a running prefix instead of the look-back.
// * topk_decode: cudaMemsetAsync of out, then one thread per (row, j) writes out[row, idx] = value. An index
//   outside [0, L) is skipped and counted in *bad (the binding raises); indices from topk_encode are
//   distinct, so the writes never collide (with duplicate indices, one of the values lands).
// * Plain CUDA C++ (raw pointers and a stream) so nvcc compiles it on CPU-only CI; topk_binding.cpp
//   validates the tensors and allocates the scratch (topk_scratch_bytes).
#include <cuda_runtime.h>

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "common.cuh"

namespace ppq_cuda {
namespace {

constexpr int kThreads = 256;                // blocks of the long-row kernels
constexpr int kWarps = kThreads / 32;
constexpr int kItems = 16;                   // values per thread per tile
constexpr int kTile = kThreads * kItems;     // 4096 values per tile
constexpr int kRowThreads = 512;             // the one-block-per-row kernel (and the sample)
constexpr int kRowWarps = kRowThreads / 32;
constexpr int kRowItems = 8;
constexpr int64_t kMinFastL = int64_t(1) << 16;
constexpr int kSampleChunks = 64, kSampleChunk = 256, kSample = kSampleChunks * kSampleChunk;
constexpr int kSampleShift = 19, kSampleBins = 1 << (31 - kSampleShift);  // 4096 bins of the key's top 12 bits
constexpr int kBins = 2048;                  // radix digits: key >> 20, (key >> 9) & 2047, key & 511
constexpr unsigned kFull = 0xffffffffu;

// Look-back status words: flag in bits 62-63 (0 none yet, 1 the tile's own counts, 2 inclusive prefix),
// two counts below: "greater" in bits 0-30, "equal" in bits 31-61 (each < 2^31, so packed words add).
constexpr uint64_t kAggregate = uint64_t(1) << 62, kPrefix = uint64_t(2) << 62;
constexpr uint64_t kValueMask = (uint64_t(1) << 62) - 1;
__device__ __forceinline__ uint64_t pack_counts(uint32_t greater, uint32_t equal) {
  return (uint64_t(equal) << 31) | greater;
}

struct RowState {  // per row, zeroed by each call
  uint32_t lo;     // candidate bound: keys >= lo
  uint32_t fail;   // 1: the one-block kernel does this row
  uint32_t tiles_x, tiles_c;  // tile counters of the compaction and of the selection
  uint32_t nc;     // candidates (may exceed the buffer: then the row fails)
  uint32_t done[3];  // finished blocks of the compaction and of the two histogram passes
  uint32_t prefix;   // digits found so far (after the last pass: the k-th largest key T)
  uint32_t need;     // values still to take among those matching prefix (at the end: ties)
  uint32_t pad[6];
};

template <class E>
__device__ __forceinline__ uint32_t key_of_bits(uint32_t raw) {
  return __float_as_uint(E::to_f32(E::from_bits(raw))) & 0x7fffffffu;
}

// A full warp finds, in a histogram of NB bins (read through ld(i)), the digit d with
// sum(bins > d) < need <= sum(bins >= d); returns d and above = sum(bins > d) to every lane.
template <int NB, typename Load>
__device__ __forceinline__ void warp_pick(Load ld, uint32_t need, uint32_t& digit, uint32_t& above) {
  constexpr int C = NB / 32;
  const int lane = threadIdx.x & 31;
  const int top = NB - lane * C;  // this lane's bins: [top - C, top), lane 0 holds the highest
  uint32_t s = 0;
  for (int q = 1; q <= C; ++q) s += ld(top - q);
  uint32_t incl = s;
  for (int o = 1; o < 32; o <<= 1) {
    const uint32_t t = __shfl_up_sync(kFull, incl, o);
    if (lane >= o) incl += t;
  }
  const unsigned hit = __ballot_sync(kFull, incl >= need);
  const int f = hit ? __ffs(hit) - 1 : 31;  // the lane where the running count reaches need
  uint32_t d = 0, ab = 0;
  if (lane == f) {
    uint32_t acc = incl - s;
    for (int q = 1; q <= C; ++q) {
      const uint32_t h = ld(top - q);
      if (acc + h >= need) {
        d = uint32_t(top - q);
        ab = acc;
        break;
      }
      acc += h;
    }
  }
  digit = __shfl_sync(kFull, d, f);
  above = __shfl_sync(kFull, ab, f);
}

// Exclusive prefixes, in position order, of the (greater, equal) counts of a tile's ITEMS x WARPS warp
// slices (slice j * WARPS + w holds positions base + j * 32 * WARPS + w * 32 + [0, 32)). Run by warp 0;
// returns the tile's totals to every lane.
template <int ITEMS, int WARPS>
__device__ __forceinline__ void scan_slices(uint32_t* g, uint32_t* e, uint32_t& gtot, uint32_t& etot) {
  static_assert(ITEMS * WARPS == 128, "four slices per lane");
  const int lane = threadIdx.x & 31;
  uint32_t gl[4], el[4], gs = 0, es = 0;
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    gl[q] = g[4 * lane + q];
    el[q] = e[4 * lane + q];
    gs += gl[q];
    es += el[q];
  }
  uint32_t gi = gs, ei = es;
  for (int o = 1; o < 32; o <<= 1) {
    const uint32_t gt = __shfl_up_sync(kFull, gi, o), et = __shfl_up_sync(kFull, ei, o);
    if (lane >= o) {
      gi += gt;
      ei += et;
    }
  }
  uint32_t gx = gi - gs, ex = ei - es;
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    g[4 * lane + q] = gx;
    e[4 * lane + q] = ex;
    gx += gl[q];
    ex += el[q];
  }
  gtot = __shfl_sync(kFull, gi, 31);
  etot = __shfl_sync(kFull, ei, 31);
}

// Decoupled look-back, run by warp 0 of tile t: publishes the tile's packed counts `own`, sums its
// predecessors' until one with an inclusive prefix, publishes its own inclusive prefix and returns the
// exclusive one (packed) to every lane.
__device__ __forceinline__ uint64_t look_back(unsigned long long* status, uint32_t t, uint64_t own) {
  const int lane = threadIdx.x & 31;
  if (lane == 0) atomicExch(status + t, (unsigned long long)((t == 0 ? kPrefix : kAggregate) | own));
  uint64_t excl = 0;
  if (t > 0) {
    int64_t hi = int64_t(t) - 1;
    for (;;) {
      const int64_t j = hi - lane;
      uint64_t s = kPrefix;  // before tile 0: an inclusive prefix of 0
      if (j >= 0) {
        do {
          s = *reinterpret_cast<volatile unsigned long long*>(status + j);
        } while ((s >> 62) == 0);
      }
      const unsigned pm = __ballot_sync(kFull, (s >> 62) == 2);
      const int stop = pm ? __ffs(pm) - 1 : 31;  // the nearest predecessor with an inclusive prefix
      uint64_t v = lane <= stop ? (s & kValueMask) : 0;
      for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
      excl += v;
      if (pm) break;
      hi -= 32;
    }
    if (lane == 0) atomicExch(status + t, (unsigned long long)(kPrefix | (excl + own)));
  }
  return excl;
}

// Whether this block is the last of `blocks` to finish (its global writes and atomics before are visible
// to the last one, which reads them with __ldcg).
__device__ __forceinline__ bool last_block_done(uint32_t* done, uint32_t blocks, int* flag) {
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) *flag = atomicAdd(done, 1u) == blocks - 1;
  __syncthreads();
  return *flag != 0;
}

// ---- long rows: 1. the candidate bound from a sample ------------------------------------------------------
template <class E>
__global__ void __launch_bounds__(kRowThreads)
    topk_bound_kernel(const typename E::T* __restrict__ x, int64_t L, int64_t k, RowState* __restrict__ rows) {
  __shared__ uint32_t hist[kSampleBins];
  const int64_t b = blockIdx.x;
  const typename E::T* row = x + b * L;
  for (int i = threadIdx.x; i < kSampleBins; i += kRowThreads) hist[i] = 0;
  __syncthreads();
  const int64_t stride = L / kSampleChunks;
  for (int s = threadIdx.x; s < kSample; s += kRowThreads) {
    const uint32_t key = __float_as_uint(E::to_f32(row[(s / kSampleChunk) * stride + s % kSampleChunk])) & 0x7fffffffu;
    atomicAdd(&hist[key >> kSampleShift], 1u);
  }
  __syncthreads();
  if (threadIdx.x < 32) {
    const double share = double(k) * double(kSample) / double(L);
    const int64_t want = int64_t(share * 1.1 + 4.0 * sqrt(share) + 16.0);
    if (want >= kSample) {  // k is most of the row: every value would be a candidate
      if (threadIdx.x == 0) rows[b].fail = 1;
    } else {
      uint32_t bin, above;
      warp_pick<kSampleBins>([&](int i) { return hist[i]; }, uint32_t(want), bin, above);
      if (threadIdx.x == 0) rows[b].lo = bin << kSampleShift;
    }
  }
}

// ---- long rows: 2. candidates (key >= lo) in index order, and the first digit's histogram ----------------
template <class E>
__global__ void __launch_bounds__(kThreads)
    topk_compact_kernel(const typename E::T* __restrict__ x, int64_t L, int64_t k, int64_t cap, uint32_t ntiles,
                        RowState* __restrict__ rows, uint32_t* __restrict__ hists, unsigned long long* __restrict__ lb,
                        uint32_t* __restrict__ cand_idx, uint32_t* __restrict__ cand_bits, uint8_t* __restrict__ status) {
  __shared__ uint32_t hist[kBins];
  __shared__ uint32_t sg[kItems * kWarps], se[kItems * kWarps];
  __shared__ uint32_t s_tile, s_prefix;
  __shared__ int s_flag;
  const int64_t b = blockIdx.y;
  RowState* st = rows + b;
  if (st->fail) return;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (threadIdx.x == 0) s_tile = atomicAdd(&st->tiles_x, 1u);
  for (int i = threadIdx.x; i < kBins; i += kThreads) hist[i] = 0;
  __syncthreads();
  const uint32_t t = s_tile, lo = st->lo;
  const typename E::T* row = x + b * L;
  const int64_t base = int64_t(t) * kTile;
  uint32_t raw[kItems], bal[kItems];
  bool bad = false;
#pragma unroll
  for (int j = 0; j < kItems; ++j) {
    const int64_t pos = base + j * kThreads + threadIdx.x;
    raw[j] = pos < L ? E::bits(row[pos]) : 0u;
  }
#pragma unroll
  for (int j = 0; j < kItems; ++j) {
    const int64_t pos = base + j * kThreads + threadIdx.x;
    const uint32_t key = key_of_bits<E>(raw[j]);
    const bool take = pos < L && key >= lo;
    bad |= pos < L && key >= 0x7f800000u;
    if (take) atomicAdd(&hist[key >> 20], 1u);
    bal[j] = __ballot_sync(kFull, take);
    if (lane == 0) {
      sg[j * kWarps + warp] = __popc(bal[j]);
      se[j * kWarps + warp] = 0;
    }
  }
  if (bad) *status = 1;
  __syncthreads();
  if (warp == 0) {
    uint32_t gtot, etot;
    scan_slices<kItems, kWarps>(sg, se, gtot, etot);
    const uint64_t excl = look_back(lb + b * ntiles, t, pack_counts(gtot, 0));
    if (lane == 0) {
      s_prefix = uint32_t(excl & 0x7fffffffu);
      if (t == ntiles - 1) st->nc = s_prefix + gtot;
    }
  }
  __syncthreads();
  const unsigned lt = (1u << lane) - 1u;
  uint32_t* ci = cand_idx + b * cap;
  uint32_t* cb = cand_bits + b * cap;
#pragma unroll
  for (int j = 0; j < kItems; ++j) {
    if (bal[j] >> lane & 1u) {
      const int64_t out = int64_t(s_prefix) + sg[j * kWarps + warp] + __popc(bal[j] & lt);
      if (out < cap) {
        ci[out] = uint32_t(base + j * kThreads + threadIdx.x);
        cb[out] = raw[j];
      }
    }
  }
  uint32_t* gh = hists + b * 3 * kBins;
  for (int i = threadIdx.x; i < kBins; i += kThreads)
    if (hist[i]) atomicAdd(gh + i, hist[i]);
  if (last_block_done(&st->done[0], ntiles, &s_flag) && warp == 0) {  // pick the first digit
    const uint32_t nc = __ldcg(&st->nc);
    if (nc < k || nc > cap) {
      if (lane == 0) st->fail = 1;
    } else {
      uint32_t d, above;
      warp_pick<kBins>([&](int i) { return __ldcg(gh + i); }, uint32_t(k), d, above);
      if (lane == 0) {
        st->prefix = d;
        st->need = uint32_t(k) - above;
      }
    }
  }
}

// ---- long rows: 3. digit ROUND (2: bits 9-19, 3: bits 0-8) over the candidates matching the prefix -------
template <class E, int ROUND>
__global__ void __launch_bounds__(kThreads)
    topk_refine_kernel(int64_t cap, uint32_t nblocks, RowState* __restrict__ rows, uint32_t* __restrict__ hists,
                       const uint32_t* __restrict__ cand_bits) {
  constexpr int NB = ROUND == 2 ? kBins : 512;
  constexpr int kShift = ROUND == 2 ? 20 : 9;  // the prefix is key >> kShift
  __shared__ uint32_t hist[NB];
  __shared__ int s_flag;
  const int64_t b = blockIdx.y;
  RowState* st = rows + b;
  if (st->fail) return;
  const uint32_t nc = st->nc, prefix = st->prefix, need = st->need;
  for (int i = threadIdx.x; i < NB; i += kThreads) hist[i] = 0;
  __syncthreads();
  const uint32_t* cb = cand_bits + b * cap;
  for (int64_t pos = int64_t(blockIdx.x) * kTile + threadIdx.x; pos < nc && pos < int64_t(blockIdx.x + 1) * kTile;
       pos += kThreads) {
    const uint32_t key = key_of_bits<E>(cb[pos]);
    if ((key >> kShift) == prefix) atomicAdd(&hist[ROUND == 2 ? (key >> 9) & (kBins - 1) : key & 511u], 1u);
  }
  __syncthreads();
  uint32_t* gh = hists + (b * 3 + ROUND - 1) * kBins;
  for (int i = threadIdx.x; i < NB; i += kThreads)
    if (hist[i]) atomicAdd(gh + i, hist[i]);
  if (last_block_done(&st->done[ROUND - 1], nblocks, &s_flag) && threadIdx.x < 32) {
    uint32_t d, above;
    warp_pick<NB>([&](int i) { return __ldcg(gh + i); }, need, d, above);
    if (threadIdx.x == 0) {
      st->prefix = (prefix << (ROUND == 2 ? 11 : 9)) | d;
      st->need = need - above;
    }
  }
}

// ---- long rows: 4. the taken candidates, in index order ---------------------------------------------------
template <class E>
__global__ void __launch_bounds__(kThreads)
    topk_select_kernel(int64_t k, int64_t cap, uint32_t ntiles_max, RowState* __restrict__ rows,
                       unsigned long long* __restrict__ lb, const uint32_t* __restrict__ cand_idx,
                       const uint32_t* __restrict__ cand_bits, typename E::T* __restrict__ values,
                       int64_t* __restrict__ indices) {
  __shared__ uint32_t sg[kItems * kWarps], se[kItems * kWarps];
  __shared__ uint32_t s_tile, s_g, s_e;
  const int64_t b = blockIdx.y;
  RowState* st = rows + b;
  if (st->fail) return;
  const uint32_t nc = st->nc, T = st->prefix, ties = st->need;
  const uint32_t ntiles = (nc + kTile - 1) / kTile;
  if (threadIdx.x == 0) s_tile = atomicAdd(&st->tiles_c, 1u);
  __syncthreads();
  const uint32_t t = s_tile;
  if (t >= ntiles) return;  // more blocks than this row's candidate tiles
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const uint32_t* ci = cand_idx + b * cap;
  const uint32_t* cb = cand_bits + b * cap;
  const int64_t base = int64_t(t) * kTile;
  uint32_t raw[kItems], gb[kItems], eb[kItems];
#pragma unroll
  for (int j = 0; j < kItems; ++j) {
    const int64_t pos = base + j * kThreads + threadIdx.x;
    raw[j] = pos < nc ? cb[pos] : 0u;
  }
#pragma unroll
  for (int j = 0; j < kItems; ++j) {
    const int64_t pos = base + j * kThreads + threadIdx.x;
    const uint32_t key = key_of_bits<E>(raw[j]);
    gb[j] = __ballot_sync(kFull, pos < nc && key > T);
    eb[j] = __ballot_sync(kFull, pos < nc && key == T);
    if (lane == 0) {
      sg[j * kWarps + warp] = __popc(gb[j]);
      se[j * kWarps + warp] = __popc(eb[j]);
    }
  }
  __syncthreads();
  if (warp == 0) {
    uint32_t gtot, etot;
    scan_slices<kItems, kWarps>(sg, se, gtot, etot);
    const uint64_t excl = look_back(lb + b * ntiles_max, t, pack_counts(gtot, etot));
    if (lane == 0) {
      s_g = uint32_t(excl & 0x7fffffffu);
      s_e = uint32_t(excl >> 31);
    }
  }
  __syncthreads();
  const unsigned lt = (1u << lane) - 1u;
#pragma unroll
  for (int j = 0; j < kItems; ++j) {
    const bool greater = gb[j] >> lane & 1u, equal = eb[j] >> lane & 1u;
    if (!greater && !equal) continue;
    const uint32_t g_before = s_g + sg[j * kWarps + warp] + __popc(gb[j] & lt);
    const uint32_t e_before = s_e + se[j * kWarps + warp] + __popc(eb[j] & lt);
    if (greater || e_before < ties) {
      const int64_t out = b * k + g_before + (e_before < ties ? e_before : ties);
      indices[out] = ci[base + j * kThreads + threadIdx.x];
      values[out] = E::from_bits(raw[j]);
    }
  }
}

// ---- short rows and failed rows: one block per row --------------------------------------------------------
template <class E>
__global__ void __launch_bounds__(kRowThreads)
    topk_row_kernel(const typename E::T* __restrict__ x, int64_t L, int64_t k, const RowState* __restrict__ rows,
                    typename E::T* __restrict__ values, int64_t* __restrict__ indices, uint8_t* __restrict__ status) {
  __shared__ uint32_t hist[kBins];
  __shared__ uint32_t sg[kRowItems * kRowWarps], se[kRowItems * kRowWarps];
  __shared__ uint32_t s_digit, s_need, s_g, s_e;
  const int64_t b = blockIdx.x;
  if (rows != nullptr && !rows[b].fail) return;  // the long-row kernels did this row
  const typename E::T* row = x + b * L;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  // three histogram rounds: the k-th largest key T, and how many keys == T are taken
  uint32_t prefix = 0, need = uint32_t(k);
  bool bad = false;
#pragma unroll 1
  for (int round = 1; round <= 3; ++round) {
    const int shift = round == 1 ? 20 : (round == 2 ? 9 : 0);
    const uint32_t dmask = round == 3 ? 511u : uint32_t(kBins - 1);
    for (int i = threadIdx.x; i < kBins; i += kRowThreads) hist[i] = 0;
    __syncthreads();
    for (int64_t i = threadIdx.x; i < L; i += kRowThreads) {
      const uint32_t key = __float_as_uint(E::to_f32(row[i])) & 0x7fffffffu;
      if (round == 1) {
        bad |= key >= 0x7f800000u;
        atomicAdd(&hist[key >> 20], 1u);
      } else if ((key >> (round == 2 ? 20 : 9)) == prefix) {
        atomicAdd(&hist[(key >> shift) & dmask], 1u);
      }
    }
    __syncthreads();
    if (warp == 0) {
      uint32_t d, above;
      if (round == 3) warp_pick<512>([&](int i) { return hist[i]; }, need, d, above);
      else warp_pick<kBins>([&](int i) { return hist[i]; }, need, d, above);
      if (lane == 0) {
        s_digit = d;
        s_need = need - above;
      }
    }
    __syncthreads();
    prefix = round == 1 ? s_digit : (prefix << (round == 2 ? 11 : 9)) | s_digit;
    need = s_need;
  }
  if (bad) *status = 1;
  const uint32_t T = prefix, ties = need;
  // ordered write, chunk by chunk, with a running (greater, equal) count
  uint32_t g_run = 0, e_run = 0;
  const unsigned lt = (1u << lane) - 1u;
  for (int64_t base = 0; base < L; base += kRowThreads * kRowItems) {
    uint32_t raw[kRowItems], gb[kRowItems], eb[kRowItems];
#pragma unroll
    for (int j = 0; j < kRowItems; ++j) {
      const int64_t pos = base + j * kRowThreads + threadIdx.x;
      raw[j] = pos < L ? E::bits(row[pos]) : 0u;
      const uint32_t key = key_of_bits<E>(raw[j]);
      gb[j] = __ballot_sync(kFull, pos < L && key > T);
      eb[j] = __ballot_sync(kFull, pos < L && key == T);
      if (lane == 0) {
        sg[j * kRowWarps + warp] = __popc(gb[j]);
        se[j * kRowWarps + warp] = __popc(eb[j]);
      }
    }
    __syncthreads();
    if (warp == 0) {
      uint32_t gtot, etot;
      scan_slices<kRowItems, kRowWarps>(sg, se, gtot, etot);
      if (lane == 0) {
        s_g = gtot;
        s_e = etot;
      }
    }
    __syncthreads();
#pragma unroll
    for (int j = 0; j < kRowItems; ++j) {
      const bool greater = gb[j] >> lane & 1u, equal = eb[j] >> lane & 1u;
      if (!greater && !equal) continue;
      const uint32_t g_before = g_run + sg[j * kRowWarps + warp] + __popc(gb[j] & lt);
      const uint32_t e_before = e_run + se[j * kRowWarps + warp] + __popc(eb[j] & lt);
      if (greater || e_before < ties) {
        const int64_t out = b * k + g_before + (e_before < ties ? e_before : ties);
        indices[out] = base + j * kRowThreads + threadIdx.x;
        values[out] = E::from_bits(raw[j]);
      }
    }
    g_run += s_g;
    e_run += s_e;
    __syncthreads();  // sg/se/s_g/s_e are rewritten by the next chunk
  }
}

template <class E>
__global__ void topk_scatter_kernel(const typename E::T* __restrict__ values, const int64_t* __restrict__ indices,
                                    int64_t B, int64_t L, int64_t k, typename E::T* __restrict__ out, int* bad) {
  const int64_t n = B * k;
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < n; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = indices[e], b = e / k;
    if (i >= 0 && i < L) out[b * L + i] = values[e];
    else atomicAdd(bad, 1);
  }
}

// ---- scratch layout ------------------------------------------------------------------------------------------
constexpr size_t kAlign = 256;
size_t align_up(size_t v) { return (v + kAlign - 1) / kAlign * kAlign; }

struct Layout {
  int64_t cap;             // candidate slots per row
  uint32_t ntx, ntc;       // tiles of a row of x, of a row's candidate buffer
  size_t rows, hists, lbx, lbc, zeroed, cidx, cbits, total;  // byte offsets / sizes
};

Layout layout(int64_t B, int64_t L, int64_t k) {
  Layout l;
  const int64_t cap = 3 * k + 8192;
  l.cap = cap < L ? cap : L;
  l.ntx = uint32_t((L + kTile - 1) / kTile);
  l.ntc = uint32_t((l.cap + kTile - 1) / kTile);
  l.rows = 0;
  l.hists = align_up(l.rows + sizeof(RowState) * size_t(B));
  l.lbx = align_up(l.hists + sizeof(uint32_t) * 3 * kBins * size_t(B));
  l.lbc = align_up(l.lbx + sizeof(unsigned long long) * size_t(l.ntx) * size_t(B));
  l.zeroed = align_up(l.lbc + sizeof(unsigned long long) * size_t(l.ntc) * size_t(B));
  l.cidx = l.zeroed;
  l.cbits = align_up(l.cidx + sizeof(uint32_t) * size_t(l.cap) * size_t(B));
  l.total = align_up(l.cbits + sizeof(uint32_t) * size_t(l.cap) * size_t(B));
  return l;
}

constexpr int64_t kMaxGridRows = 65535;  // gridDim.y

}  // namespace

size_t topk_scratch_bytes(int64_t B, int64_t L, int64_t k) {
  if (L < kMinFastL || B == 0) return 0;
  const int64_t rows = B < kMaxGridRows ? B : kMaxGridRows;  // rows are done in batches of at most this many
  return layout(rows, L, k).total;
}

cudaError_t topk_encode(const void* x, int dt, int64_t B, int64_t L, int64_t k, void* values, int64_t* indices,
                        uint8_t* status, void* scratch, cudaStream_t stream) {
  cudaError_t e = cudaMemsetAsync(status, 0, 1, stream);
  if (e != cudaSuccess || B == 0) return e;
  return common::dispatch_float(dt, [&](auto tag) {
    using E = decltype(tag);
    using T = typename E::T;
    const T* xp = static_cast<const T*>(x);
    T* vp = static_cast<T*>(values);
    if (L < kMinFastL) {
      topk_row_kernel<E><<<unsigned(B), kRowThreads, 0, stream>>>(xp, L, k, nullptr, vp, indices, status);
      return cudaGetLastError();
    }
    for (int64_t r0 = 0; r0 < B; r0 += kMaxGridRows) {
      const int64_t nr = B - r0 < kMaxGridRows ? B - r0 : kMaxGridRows;
      const Layout l = layout(nr, L, k);
      char* s = static_cast<char*>(scratch);
      auto* rows = reinterpret_cast<RowState*>(s + l.rows);
      auto* hists = reinterpret_cast<uint32_t*>(s + l.hists);
      auto* lbx = reinterpret_cast<unsigned long long*>(s + l.lbx);
      auto* lbc = reinterpret_cast<unsigned long long*>(s + l.lbc);
      auto* cidx = reinterpret_cast<uint32_t*>(s + l.cidx);
      auto* cbits = reinterpret_cast<uint32_t*>(s + l.cbits);
      const T* xr = xp + r0 * L;
      T* vr = vp + r0 * k;
      int64_t* ir = indices + r0 * k;
      cudaError_t err = cudaMemsetAsync(scratch, 0, l.zeroed, stream);
      if (err != cudaSuccess) return err;
      topk_bound_kernel<E><<<unsigned(nr), kRowThreads, 0, stream>>>(xr, L, k, rows);
      topk_compact_kernel<E><<<dim3(l.ntx, unsigned(nr)), kThreads, 0, stream>>>(xr, L, k, l.cap, l.ntx, rows, hists,
                                                                                 lbx, cidx, cbits, status);
      topk_refine_kernel<E, 2><<<dim3(l.ntc, unsigned(nr)), kThreads, 0, stream>>>(l.cap, l.ntc, rows, hists, cbits);
      topk_refine_kernel<E, 3><<<dim3(l.ntc, unsigned(nr)), kThreads, 0, stream>>>(l.cap, l.ntc, rows, hists, cbits);
      topk_select_kernel<E><<<dim3(l.ntc, unsigned(nr)), kThreads, 0, stream>>>(k, l.cap, l.ntc, rows, lbc, cidx,
                                                                                cbits, vr, ir);
      topk_row_kernel<E><<<unsigned(nr), kRowThreads, 0, stream>>>(xr, L, k, rows, vr, ir, status);
      err = cudaGetLastError();
      if (err != cudaSuccess) return err;
    }
    return cudaSuccess;
  });
}

cudaError_t topk_decode(const void* values, const int64_t* indices, int dt, int64_t B, int64_t L, int64_t k,
                        void* out, int* bad, cudaStream_t stream) {
  cudaError_t e = cudaMemsetAsync(bad, 0, sizeof(int), stream);
  if (e != cudaSuccess) return e;
  return common::dispatch_float(dt, [&](auto tag) {
    using E = decltype(tag);
    using T = typename E::T;
    cudaError_t err = cudaMemsetAsync(out, 0, size_t(B) * size_t(L) * sizeof(T), stream);
    if (err != cudaSuccess || B * k == 0) return err;
    topk_scatter_kernel<E><<<common::grid_blocks(B * k, 256), 256, 0, stream>>>(
        static_cast<const T*>(values), indices, B, L, k, static_cast<T*>(out), bad);
    return cudaGetLastError();
  });
}

}  // namespace ppq_cuda
