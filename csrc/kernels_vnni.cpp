// VNNI kernels: the 256-bit kernels of kernels_x86.inc with vpdpbusd dot products (one
// instruction for u8 x s8 products summed into int32, where AVX2 needs maddubs + madd).
// Two tables: AVX-512 VNNI (EVEX; its integer GEMM 512 bits wide, kernels_zmm.inc, with the
// same results) and AVX-VNNI (VEX). They run only where the CPU reports the features;
// tests/test_kernels.py checks every path the CPU has (both run on an Intel Xeon with
// AVX-512 VNNI and AVX-VNNI).
#include <immintrin.h>
#include <math.h>

#include <cstring>
#include <new>
#include <stdlib.h>
#include <vector>

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
#include "kernels_raw.inc"
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
#include "kernels_raw.inc"
}  // namespace
#undef MOERUN_TARGET
#undef MOERUN_DPBUSD
}  // namespace avxvnni

// AVX-512 BF16 (Zen 4, Cooper Lake, Sapphire Rapids): the avx512vnni table with bf16 weight
// rows run as vdpbf16ps dot products (two bf16 products per lane into float32, 32 inputs an
// instruction, no widening of the weights). The products take bf16 activations: a token
// whose float32 activations are all bf16 values (what a bf16 model's layers take in) runs as
// they are; any other token as two bf16 halves, x = hi + lo (hi: x's top 16 bits, lo: the
// rest rounded to bf16, within 2^-17 of x), both into the same chains. Which of the two a
// token takes depends only on its own values, so what a (row, token) gives never depends on
// the call's other tokens or rows (a verification pass still equals its decode steps bit
// for bit). vdpbf16ps adds each lane's two exact products (bf16 x bf16 fits float32) into
// the lane with float32 rounding, reads denormal inputs as zero and flushes denormal
// results: within the torch reference's tolerance, not its bits (nor avx512vnni's).
// Measured (benchmarks/gemm.py --formats bfloat16, bf16 activations, against avx512vnni's
// FMA path, Zen 4): 3 x 2048 x 2048 on one thread 74 vs 38 GMAC/s, 16 x 4096 x 2048 on two
// 101 vs 58, 1 x 4096 x 2048 60 vs 46 GB/s of weights.
namespace avx512bf16 {
#define MOERUN_BF16_TARGET __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni,avx512bf16")))
namespace {

// Lanes i and i + 8 added: a row's 16 lane sums to the 8 that hsum8 reduces.
MOERUN_BF16_TARGET inline __m256 fold16(__m512 v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}

// 32 inputs of RB rows x TT tokens: each token's hi half (and with SPLIT its lo half) into
// its row's chain. Full steps use plain loads (masked ones cost ~2x on Zen 4); the row's last
// partial 32 masked ones (zeros past the row; the activations are zero-padded).
template <int TT, int RB, bool SPLIT, bool TAIL>
MOERUN_BF16_TARGET inline void dp_step(const uint16_t* const* w, int j, __mmask32 m, const uint16_t* const* hi,
                                       const uint16_t* const* lo, __m512 (*acc)[RB]) {
    __m512i xh[TT], xl[TT];
    for (int t = 0; t < TT; ++t) {
        xh[t] = _mm512_loadu_si512((const void*)(hi[t] + j));
        if (SPLIT) xl[t] = _mm512_loadu_si512((const void*)(lo[t] + j));
    }
    for (int r = 0; r < RB; ++r) {
        const __m512i wv = TAIL ? _mm512_maskz_loadu_epi16(m, w[r] + j) : _mm512_loadu_si512((const void*)(w[r] + j));
        for (int t = 0; t < TT; ++t) {
            acc[t][r] = _mm512_dpbf16_ps(acc[t][r], (__m512bh)wv, (__m512bh)xh[t]);
            if (SPLIT) acc[t][r] = _mm512_dpbf16_ps(acc[t][r], (__m512bh)wv, (__m512bh)xl[t]);
        }
    }
}

// Rows r0 .. r0 + nr (nr <= RB) x TT tokens (bf16 halves hi[t], lo[t], zero-padded to a
// multiple of 32) -> y[t][r]: one chain per (row, token), then fold16 and hsum8 (each row's
// lanes kept to itself). A block of fewer than RB rows repeats its last row in the rest
// (their sums dropped): every block runs the same fixed-size loop, its accumulators in
// registers (24 of the 32 with 3 tokens, plus 6 activation registers when split).
template <int TT, int RB, bool SPLIT>
MOERUN_BF16_TARGET void dp_rows(const GemmArgs& a, int r0, int nr, const uint16_t* const* hi, const uint16_t* const* lo,
                                float* const* y) {
    const int n = a.in, n32 = n & ~31, rem = n - n32;
    const uint16_t* w[RB];
    for (int r = 0; r < RB; ++r) w[r] = (const uint16_t*)(a.w + (size_t)(r0 + (r < nr ? r : nr - 1)) * a.w_row);
    __m512 acc[TT][RB];
    for (int t = 0; t < TT; ++t)
        for (int r = 0; r < RB; ++r) acc[t][r] = _mm512_setzero_ps();
    for (int j = 0; j < n32; j += 32) dp_step<TT, RB, SPLIT, false>(w, j, 0, hi, lo, acc);
    if (rem) dp_step<TT, RB, SPLIT, true>(w, n32, (__mmask32)((1u << rem) - 1), hi, lo, acc);
    for (int t = 0; t < TT; ++t) {
        __m256 h[8];
        for (int r = 0; r < 8; ++r) h[r] = r < RB ? fold16(acc[t][r]) : _mm256_setzero_ps();
        alignas(32) float s[8];
        _mm256_store_ps(s, avx512vnni::hsum8(h));
        for (int r = 0; r < nr; ++r) y[t][r] = s[r];
    }
}

// x's n float32 values as bf16 halves, zero-padded to a multiple of 32: hi the top 16 bits
// of each (a NaN kept a NaN: its quiet bit set, where its payload was in the low bits
// only), lo what is left (exact in float32) rounded to nearest even; lo 0 where x is inf or
// NaN. Returns whether every lo is 0 (x's values are all bf16 values: lo unused).
MOERUN_BF16_TARGET bool bf16_halves(const float* x, int n, uint16_t* hi, uint16_t* lo) {
    const __m512i top = _mm512_set1_epi32((int)0xffff0000u), expo = _mm512_set1_epi32(0x7f800000);
    const __m512i magnitude = _mm512_set1_epi32(0x7fffffff), quiet = _mm512_set1_epi32(0x00400000);
    bool exact = true;
    for (int j = 0; j < n; j += 16) {
        const __mmask16 m = n - j >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - j)) - 1);
        const __m512i v = _mm512_maskz_loadu_epi32(m, x + j);
        const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(v, magnitude), expo);
        const __m512i h = _mm512_mask_or_epi32(_mm512_and_si512(v, top), nan, v, quiet);
        const __mmask16 finite = _mm512_cmpneq_epi32_mask(_mm512_and_si512(v, expo), expo);
        const __m512 rest = _mm512_maskz_sub_ps(finite, _mm512_castsi512_ps(v), _mm512_castsi512_ps(h));
        exact &= _mm512_test_epi32_mask(_mm512_castps_si512(rest), _mm512_castps_si512(rest)) == 0;
        _mm256_storeu_si256((__m256i*)(hi + j), _mm512_cvtepi32_epi16(_mm512_srli_epi32(h, 16)));
        _mm256_storeu_si256((__m256i*)(lo + j), (__m256i)_mm512_cvtneps_pbh(rest));
    }
    const int np = (n + 31) & ~31;
    for (int j = (n + 15) & ~15; j < np; ++j) hi[j] = lo[j] = 0;
    return exact;
}

constexpr int kTokens = 3;  // tokens per pass over a block of 8 rows

template <bool SPLIT>
MOERUN_BF16_TARGET void dp_tokens(const GemmArgs& a, const std::vector<int>& toks, const uint16_t* halves, int np) {
    const int nt = (int)toks.size();
    for (int r0 = 0; r0 < a.nrows; r0 += 8) {
        const int nr = a.nrows - r0 < 8 ? a.nrows - r0 : 8;
        for (int t0 = 0; t0 < nt;) {
            const int tt = nt - t0 < kTokens ? nt - t0 : kTokens;
            const uint16_t *hi[kTokens], *lo[kTokens];
            float* y[kTokens];
            for (int t = 0; t < tt; ++t) {
                const int i = toks[t0 + t];
                hi[t] = halves + (size_t)i * 2 * np;
                lo[t] = hi[t] + np;
                y[t] = a.y + (size_t)i * a.y_row + r0;
            }
            if (tt == 3)
                dp_rows<3, 8, SPLIT>(a, r0, nr, hi, lo, y);
            else if (tt == 2)
                dp_rows<2, 8, SPLIT>(a, r0, nr, hi, lo, y);
            else
                dp_rows<1, 8, SPLIT>(a, r0, nr, hi, lo, y);
            t0 += tt;
        }
    }
}

MOERUN_BF16_TARGET void gemm_bf16(const GemmArgs& a) {
    const int n = a.in, np = (n + 31) & ~31;
    thread_local std::vector<uint16_t> halves;  // token i: hi at i * 2 * np, lo right after
    thread_local std::vector<int> exact, split;
    halves.resize((size_t)a.ntok * 2 * np);
    exact.clear();
    split.clear();
    for (int i = 0; i < a.ntok; ++i) {
        uint16_t* hi = halves.data() + (size_t)i * 2 * np;
        const float* x = a.xf + (size_t)(a.xidx ? a.xidx[i] : i) * a.x_row;
        (bf16_halves(x, n, hi, hi + np) ? exact : split).push_back(i);
    }
    if (!exact.empty()) dp_tokens<false>(a, exact, halves.data(), np);
    if (!split.empty()) dp_tokens<true>(a, split, halves.data(), np);
}

}  // namespace
#undef MOERUN_BF16_TARGET
}  // namespace avx512bf16

void gemm_bf16_dp(const GemmArgs& a) { avx512bf16::gemm_bf16(a); }

const KernelTable avx512bf16_kernels = {"avx512bf16", avx512vnni::quantize_row, avx512vnni::gemm_q4_zmm,
                                        avx512vnni::gemm_q8_zmm, avx512vnni::attn_chunk_zmm, avx512vnni::delta_head,
                                        avx512vnni::gemm_f32, avx512bf16::gemm_bf16,
                                        avx512vnni::gemm_raw};
const KernelTable avx512vnni_kernels = {"avx512vnni", avx512vnni::quantize_row, avx512vnni::gemm_q4_zmm, avx512vnni::gemm_q8_zmm,
                                        avx512vnni::attn_chunk_zmm, avx512vnni::delta_head, avx512vnni::gemm_f32,
                                        avx512vnni::gemm_bf16, avx512vnni::gemm_raw};
const KernelTable avxvnni_kernels = {"avxvnni", avxvnni::quantize_row, avxvnni::gemm_q4, avxvnni::gemm_q8,
                                     avxvnni::attn_chunk, avxvnni::delta_head, avxvnni::gemm_f32, avxvnni::gemm_bf16,
                                     avxvnni::gemm_raw};

}  // namespace moerun
