// Which instruction-set path this compilation of the CPU kernels is (see csrc/README.md).
//
// Design note. Every csrc/cpu/*.cpp is compiled once per variant (setup.py): "scalar" (plain x86-64),
// "avx2" (x86-64-v3), "avx512" (x86-64-v4) and "avx512vbmi" (x86-64-v4 with VBMI's byte permutes),
// each into its own extension module; Python imports the
// one module the CPU runs (deepspeed_ppq/ops/__init__.py). A kernel file picks its fast path with
// `#if PPQ_ISA_AVX512` / `#elif PPQ_ISA_AVX2` and keeps a scalar path for the rest, so the scalar
// module holds no AVX instruction at all (the compiler flags forbid them) and the AVX2 module no
// AVX-512 one. A loop that has an AVX2 version and no AVX-512 one is guarded by `#if PPQ_HAS_AVX2`
// (true in the avx2 and both avx512 modules): an AVX-512 CPU runs it rather than the scalar loop. The
// avx512vbmi module is the avx512 one (PPQ_ISA_AVX512) with __AVX512VBMI__ defined: a loop that has a
// VBMI form guards it with `#ifdef __AVX512VBMI__` inside its AVX-512 path. PPQ_ISA comes from
// setup.py; a build without it (PPQ_MARCH, a hand-made build) takes the widest path the compiler flags
// allow.
#pragma once

#define PPQ_ISA_SCALAR_ID 1
#define PPQ_ISA_AVX2_ID 2
#define PPQ_ISA_AVX512_ID 3
#define PPQ_ISA_AVX512VBMI_ID 4

// AVX-512 as the kernels use it: x86-64-v4's F, BW, DQ and VL subsets.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
#define PPQ_HAVE_AVX512_FLAGS 1
#else
#define PPQ_HAVE_AVX512_FLAGS 0
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__BMI2__) && defined(__F16C__)
#define PPQ_HAVE_AVX2_FLAGS 1
#else
#define PPQ_HAVE_AVX2_FLAGS 0
#endif

#ifndef PPQ_ISA
#if PPQ_HAVE_AVX512_FLAGS && defined(__AVX512VBMI__)
#define PPQ_ISA PPQ_ISA_AVX512VBMI_ID
#elif PPQ_HAVE_AVX512_FLAGS
#define PPQ_ISA PPQ_ISA_AVX512_ID
#elif PPQ_HAVE_AVX2_FLAGS
#define PPQ_ISA PPQ_ISA_AVX2_ID
#else
#define PPQ_ISA PPQ_ISA_SCALAR_ID
#endif
#endif

#if PPQ_ISA == PPQ_ISA_AVX512VBMI_ID
#if !PPQ_HAVE_AVX512_FLAGS || !defined(__AVX512VBMI__)
#error "PPQ_ISA=4 (avx512vbmi) needs -march=x86-64-v4 -mavx512vbmi or wider"
#endif
#define PPQ_ISA_AVX512 1
#define PPQ_ISA_AVX2 0
#define PPQ_HAS_AVX2 1
#define PPQ_ISA_NAME "avx512vbmi"
#elif PPQ_ISA == PPQ_ISA_AVX512_ID
#if !PPQ_HAVE_AVX512_FLAGS
#error "PPQ_ISA=3 (avx512) needs -march=x86-64-v4 or wider"
#endif
#if defined(__AVX512VBMI__) && !defined(PPQ_MARCH_BUILD)
#error "PPQ_ISA=3 (avx512) must not be compiled with VBMI enabled: the module would run only on VBMI CPUs"
#endif
#define PPQ_ISA_AVX512 1
#define PPQ_ISA_AVX2 0
#define PPQ_HAS_AVX2 1
#define PPQ_ISA_NAME "avx512"
#elif PPQ_ISA == PPQ_ISA_AVX2_ID
#if !PPQ_HAVE_AVX2_FLAGS
#error "PPQ_ISA=2 (avx2) needs -march=x86-64-v3 or wider"
#endif
#if defined(__AVX512F__)
#error "PPQ_ISA=2 (avx2) must not be compiled with AVX-512 enabled: the module would run only on AVX-512 CPUs"
#endif
#define PPQ_ISA_AVX512 0
#define PPQ_ISA_AVX2 1
#define PPQ_HAS_AVX2 1
#define PPQ_ISA_NAME "avx2"
#elif PPQ_ISA == PPQ_ISA_SCALAR_ID
#if defined(__AVX__) && !defined(PPQ_MARCH_BUILD)
#error "PPQ_ISA=1 (scalar) must be compiled for plain x86-64 (no AVX): it is the module for every CPU"
#endif
#define PPQ_ISA_AVX512 0
#define PPQ_ISA_AVX2 0
#define PPQ_HAS_AVX2 0
#define PPQ_ISA_NAME "scalar"
#else
#error "PPQ_ISA must be 1 (scalar), 2 (avx2), 3 (avx512) or 4 (avx512vbmi)"
#endif

// Force inlining of the small vector helpers and the per-8/16-lane lambdas of the kernels: GCC
// otherwise keeps some lambdas (those with several vector constants) out of line, and every call then
// passes its vectors through memory (the fp8 and NF4 encoders ran at half speed that way).
#if defined(__GNUC__)
#define PPQ_ALWAYS_INLINE __attribute__((always_inline))
#else
#define PPQ_ALWAYS_INLINE
#endif
