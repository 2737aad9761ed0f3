// AVX2 + FMA + F16C kernels (the 256-bit kernels of kernels_x86.inc with maddubs + madd dot
// products). Every function carries its own target attribute and the file uses no inline
// library templates, so no AVX2 code can leak into the generic path through the linker's
// choice of one copy of an inline function. Only reached through kernels_for() /
// best_kernels() after the CPU was checked.
#include <immintrin.h>
#include <math.h>

#include "kernels.h"

#define MOERUN_TARGET __attribute__((target("avx2,fma,f16c")))
// |pair sums| <= 2 * 127 * 127 fit int16 for int8 weights; int4's two blocks add to at most
// 2 * 2 * 15 * 127, so they are summed in int16 before the widening madd
#define MOERUN_DOT(u, x) _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), ones)
#define MOERUN_DOT2(ulo, xlo, uhi, xhi) \
    _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(ulo, xlo), _mm256_maddubs_epi16(uhi, xhi)), ones)

namespace moerun {
namespace {
#include "kernels_x86.inc"
}  // namespace

const KernelTable avx2_kernels = {"avx2", quantize_row, gemm_q4, gemm_q8, attn_chunk, delta_head};

}  // namespace moerun
