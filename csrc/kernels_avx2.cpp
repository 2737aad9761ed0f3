// AVX2 + FMA + F16C kernels. Every function carries its own target attribute and this file
// uses no inline library templates, so no AVX2 code can leak into the generic path through
// the linker's choice of one copy of an inline function. Only reached through kernels_for()
// / best_kernels() after the CPU was checked.
#include <immintrin.h>

#include "kernels.h"

#define MOERUN_AVX2 __attribute__((target("avx2,fma,f16c")))

namespace moerun {
namespace {

MOERUN_AVX2 inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

MOERUN_AVX2 void quantize_row_avx2(const float* x, int n, int nb, int8_t* q, float* d, float* s) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int b = 0; b < nb; ++b) {
        int lo = b * QK;
        __m256 v[4];
        if (lo + QK <= n) {
            for (int k = 0; k < 4; ++k) v[k] = _mm256_loadu_ps(x + lo + 8 * k);
        } else {
            float tmp[QK];
            for (int j = 0; j < QK; ++j) tmp[j] = lo + j < n ? x[lo + j] : 0.f;
            for (int k = 0; k < 4; ++k) v[k] = _mm256_loadu_ps(tmp + 8 * k);
        }
        __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                 _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        float amax = _mm_cvtss_f32(m4);
        float dd = amax / 127.f, id = amax > 0.f ? 1.f / dd : 0.f;
        __m256 vid = _mm256_set1_ps(id);
        // cvtps rounds to nearest even, like nearbyint and torch.round
        __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v[0], vid));
        __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v[1], vid));
        __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v[2], vid));
        __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v[3], vid));
        __m256i sum = _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
        __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
        // packs works per 128-bit lane: restore element order
        p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i*)(q + lo), p);
        d[b] = dd;
        s[b] = dd * (float)_mm_cvtsi128_si32(s4);
    }
}

// 32 int4 weights (16 bytes) to 32 unsigned bytes in element order.
MOERUN_AVX2 inline __m256i unpack_q4(const uint8_t* p) {
    const __m128i m4 = _mm_set1_epi8(0x0f);
    __m128i raw = _mm_loadu_si128((const __m128i*)p);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), m4), _mm_and_si128(raw, m4));
}

// One tile of R weight rows x TT tokens. Per group of 8 blocks the R x TT scale products
// d_w * d_x are computed once (8 at a time) and laid out so that the inner loop reads each
// as one memory operand. int4 runs two blocks per step: one 32-byte load holds blocks b and
// b + 1 (16 bytes each), its low nibbles are elements 0..15 of both and its high nibbles
// elements 16..31, matched by two lane permutes of the activations shared by all R rows;
// the two maddubs results are added in int16 (|sum| <= 2 * 2 * 15 * 127) before one madd.
// The int4 offset (stored q + 8) is removed at the end as 8 * sum_b d_w[b] * d_x[b] * sum(x_b).
template <int FMT, int R, int TT>
MOERUN_AVX2 void gemm_tile(const GemmArgs& a, int r0, int i0) {
    const int nb = a.nb;
    const uint8_t* w[R];
    const uint16_t* ws[R];
    for (int r = 0; r < R; ++r) {
        w[r] = a.w + (size_t)(r0 + r) * a.w_row;
        ws[r] = a.ws + (size_t)(r0 + r) * nb;
    }
    const int8_t* xq[TT];
    const float* xd[TT];
    const float* xs[TT];
    for (int t = 0; t < TT; ++t) {
        size_t j = a.xidx ? (size_t)a.xidx[i0 + t] : (size_t)(i0 + t);
        xq[t] = a.xq + j * nb * QK;
        xd[t] = a.xd + j * nb;
        xs[t] = a.xs + j * nb;
    }
    const __m256i ones = _mm256_set1_epi16(1);
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    __m256 acc[R][TT];
    for (int r = 0; r < R; ++r)
        for (int t = 0; t < TT; ++t) acc[r][t] = _mm256_setzero_ps();
    // sc[r][t][p]: lanes 0-3 the scale of block 2p of the group, lanes 4-7 of block 2p + 1
    alignas(32) float sc[R][TT][4][8];

    for (int b0 = 0; b0 < nb; b0 += 8) {
        const int n8 = nb - b0 < 8 ? nb - b0 : 8;
        if (n8 == 8) {
            for (int r = 0; r < R; ++r) {
                __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(ws[r] + b0)));
                for (int t = 0; t < TT; ++t) {
                    __m256 prod = _mm256_mul_ps(dw, _mm256_loadu_ps(xd[t] + b0));
                    for (int p = 0; p < 4; ++p)
                        _mm256_store_ps(sc[r][t][p], _mm256_permutevar8x32_ps(
                            prod, _mm256_setr_epi32(2 * p, 2 * p, 2 * p, 2 * p, 2 * p + 1, 2 * p + 1, 2 * p + 1, 2 * p + 1)));
                }
            }
        } else {
            for (int r = 0; r < R; ++r)
                for (int t = 0; t < TT; ++t)
                    for (int j = 0; j < n8; ++j) {
                        float v = _cvtsh_ss(ws[r][b0 + j]) * xd[t][b0 + j];
                        for (int l = 0; l < 4; ++l) sc[r][t][j / 2][(j % 2) * 4 + l] = v;
                    }
        }
        int j = 0;
        if (FMT == FMT_INT4) {
            for (; j + 2 <= n8; j += 2) {
                const int b = b0 + j;
                __m256i xlo[TT], xhi[TT];
                for (int t = 0; t < TT; ++t) {
                    __m256i xa = _mm256_loadu_si256((const __m256i*)(xq[t] + b * QK));
                    __m256i xc = _mm256_loadu_si256((const __m256i*)(xq[t] + (b + 1) * QK));
                    xlo[t] = _mm256_permute2x128_si256(xa, xc, 0x20);
                    xhi[t] = _mm256_permute2x128_si256(xa, xc, 0x31);
                }
                for (int r = 0; r < R; ++r) {
                    __m256i v = _mm256_loadu_si256((const __m256i*)(w[r] + b * (QK / 2)));
                    __m256i ulo = _mm256_and_si256(v, m4);
                    __m256i uhi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
                    for (int t = 0; t < TT; ++t) {
                        __m256i p16 = _mm256_add_epi16(_mm256_maddubs_epi16(ulo, xlo[t]), _mm256_maddubs_epi16(uhi, xhi[t]));
                        __m256 pf = _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, ones));
                        acc[r][t] = _mm256_fmadd_ps(pf, _mm256_load_ps(sc[r][t][j / 2]), acc[r][t]);
                    }
                }
            }
        }
        for (; j < n8; ++j) {
            const int b = b0 + j;
            __m256i xv[TT];
            for (int t = 0; t < TT; ++t) xv[t] = _mm256_loadu_si256((const __m256i*)(xq[t] + b * QK));
            for (int r = 0; r < R; ++r) {
                __m256i u, sx[TT];
                if (FMT == FMT_INT4) {
                    u = unpack_q4(w[r] + b * (QK / 2));
                    for (int t = 0; t < TT; ++t) sx[t] = xv[t];
                } else {
                    // maddubs wants one unsigned operand: |w| times x carrying w's sign
                    __m256i wv = _mm256_loadu_si256((const __m256i*)(w[r] + b * QK));
                    u = _mm256_sign_epi8(wv, wv);
                    for (int t = 0; t < TT; ++t) sx[t] = _mm256_sign_epi8(xv[t], wv);
                }
                for (int t = 0; t < TT; ++t) {
                    __m256 pf = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(u, sx[t]), ones));
                    acc[r][t] = _mm256_fmadd_ps(pf, _mm256_broadcast_ss(&sc[r][t][j / 2][(j % 2) * 4]), acc[r][t]);
                }
            }
        }
    }
    for (int r = 0; r < R; ++r) {
        for (int t = 0; t < TT; ++t) {
            float corr = 0.f;
            if (FMT == FMT_INT4) {
                __m256 c8 = _mm256_setzero_ps();
                int b = 0;
                for (; b + 8 <= nb; b += 8)
                    c8 = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(ws[r] + b))),
                                         _mm256_loadu_ps(xs[t] + b), c8);
                corr = hsum(c8);
                for (; b < nb; ++b) corr += _cvtsh_ss(ws[r][b]) * xs[t][b];
            }
            a.y[(size_t)(i0 + t) * a.y_row + r0 + r] = hsum(acc[r][t]) - 8.f * corr;
        }
    }
}

// Rows in groups of R (tail one by one) for one group of TT tokens.
template <int FMT, int R, int TT>
MOERUN_AVX2 void gemm_rows(const GemmArgs& a, int i0) {
    int r = 0;
    for (; r + R <= a.nrows; r += R) gemm_tile<FMT, R, TT>(a, r, i0);
    for (; r < a.nrows; ++r) gemm_tile<FMT, 1, TT>(a, r, i0);
}

// Tile shapes keep accumulators + activations + one weight vector within 16 ymm registers:
// many tokens share each unpacked weight block, many rows share each activation block.
template <int FMT>
MOERUN_AVX2 void gemm_avx2(const GemmArgs& a) {
    int i = 0;
    if (FMT == FMT_INT4) {
        for (; i + 2 <= a.ntok; i += 2) gemm_rows<FMT, 2, 2>(a, i);
    } else {
        for (; i + 4 <= a.ntok; i += 4) gemm_rows<FMT, 2, 4>(a, i);
        for (; i + 2 <= a.ntok; i += 2) gemm_rows<FMT, 2, 2>(a, i);
    }
    for (; i < a.ntok; ++i) gemm_rows<FMT, 4, 1>(a, i);
}

MOERUN_AVX2 void gemm_q4_avx2(const GemmArgs& a) { gemm_avx2<FMT_INT4>(a); }
MOERUN_AVX2 void gemm_q8_avx2(const GemmArgs& a) { gemm_avx2<FMT_INT8>(a); }

}  // namespace

const KernelTable avx2_kernels = {"avx2", quantize_row_avx2, gemm_q4_avx2, gemm_q8_avx2};

}  // namespace moerun
