// VNNI kernels: the 256-bit kernels of kernels_x86.inc with vpdpbusd dot products (one
// instruction for u8 x s8 products summed into int32, where AVX2 needs maddubs + madd).
// Two tables: AVX-512 VNNI (EVEX; its integer GEMM 512 bits wide, kernels_zmm.inc, with the
// same results) and AVX-VNNI (VEX). They run only where the CPU reports the features;
// tests/test_kernels.py checks every path the CPU has (both run on an Intel Xeon with
// AVX-512 VNNI and AVX-VNNI).
#include <immintrin.h>
#include <math.h>

#include "kernels.h"

#define MOERUN_DOT(u, x) MOERUN_DPBUSD(_mm256_setzero_si256(), u, x)
#define MOERUN_ACC4(acc, ulo, xlo, uhi, xhi) MOERUN_DPBUSD(MOERUN_DPBUSD(acc, ulo, xlo), uhi, xhi)
#define MOERUN_ACC4_I32(acc) (acc)
#define MOERUN_ACC8(acc, u, x) MOERUN_DPBUSD(acc, u, x)

namespace moerun {

namespace avx512vnni {
#define MOERUN_TARGET __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))
#define MOERUN_DPBUSD _mm256_dpbusd_epi32
#define MOERUN_VECTOR_REGS 32
namespace {
#include "kernels_x86.inc"
#include "kernels_zmm.inc"
}  // namespace
#undef MOERUN_TARGET
#undef MOERUN_DPBUSD
#undef MOERUN_VECTOR_REGS
}  // namespace avx512vnni

namespace avxvnni {
#define MOERUN_TARGET __attribute__((target("avx2,fma,f16c,avxvnni")))
#define MOERUN_DPBUSD _mm256_dpbusd_avx_epi32
namespace {
#include "kernels_x86.inc"
}  // namespace
#undef MOERUN_TARGET
#undef MOERUN_DPBUSD
}  // namespace avxvnni

const KernelTable avx512vnni_kernels = {"avx512vnni", avx512vnni::quantize_row, avx512vnni::gemm_q4_zmm, avx512vnni::gemm_q8_zmm,
                                        avx512vnni::attn_chunk_zmm, avx512vnni::delta_head, avx512vnni::gemm_f32,
                                        avx512vnni::gemm_bf16};
const KernelTable avxvnni_kernels = {"avxvnni", avxvnni::quantize_row, avxvnni::gemm_q4, avxvnni::gemm_q8,
                                     avxvnni::attn_chunk, avxvnni::delta_head, avxvnni::gemm_f32, avxvnni::gemm_bf16};

}  // namespace moerun
