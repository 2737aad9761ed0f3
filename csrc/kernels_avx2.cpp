// AVX2 + FMA + F16C kernels (the 256-bit kernels of kernels_x86.inc with maddubs + madd dot
// products). Every function carries its own target attribute and the file uses no inline
// library templates, so no AVX2 code can leak into the generic path through the linker's
// choice of one copy of an inline function. Only reached through kernels_for() /
// best_kernels() after the CPU was checked.
#include <immintrin.h>
#include <math.h>
#include <stdlib.h>

#include <new>

#include "kernels.h"

#define MOERUN_TARGET __attribute__((target("avx2,fma,f16c")))
// maddubs sums byte pairs into int16: |pair sum| <= 2 * 127 * 127 fits for int8 weights, which
// are widened at once by madd; int4's are at most 2 * 15 * 127, so a group's 8 loads x 2
// nibble halves add up in int16 (<= 30480) before one widening madd
#define MOERUN_DOT(u, x) _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), ones)
#define MOERUN_ACC4(acc, ulo, xlo, uhi, xhi) \
    _mm256_add_epi16(acc, _mm256_add_epi16(_mm256_maddubs_epi16(ulo, xlo), _mm256_maddubs_epi16(uhi, xhi)))
#define MOERUN_ACC4_I32(acc) _mm256_madd_epi16(acc, ones)
#define MOERUN_ACC8(acc, u, x) _mm256_add_epi32(acc, MOERUN_DOT(u, x))

namespace moerun {
namespace {
#include "kernels_x86.inc"
#include "kernels_raw.inc"
}  // namespace

const KernelTable avx2_kernels = {"avx2", quantize_row, gemm_q4, gemm_q8, attn_chunk, delta_head, gemm_f32, gemm_bf16, gemm_raw};

}  // namespace moerun
