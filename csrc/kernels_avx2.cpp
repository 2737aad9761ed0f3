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

MOERUN_AVX2 inline __m256 dot_u8i8(__m256i u, __m256i x) {
    const __m256i ones = _mm256_set1_epi16(1);
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(u, x), ones));
}

MOERUN_AVX2 inline __m256 dot_i8i8(__m256i w, __m256i x) {
    // maddubs wants one unsigned operand: |w| times x carrying w's sign (|w| <= 127, no overflow)
    return dot_u8i8(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
}

template <int FMT>
MOERUN_AVX2 inline __m256 block_dot(const uint8_t* w, int b, __m256i x) {
    if (FMT == FMT_INT4) return dot_u8i8(unpack_q4(w + b * (QK / 2)), x);
    return dot_i8i8(_mm256_loadu_si256((const __m256i*)(w + b * QK)), x);
}

// Four weight rows against one activation row: the activation block is loaded once for all
// four and the four independent accumulators hide the FMA latency.
template <int FMT>
MOERUN_AVX2 void gemm_avx2(const GemmArgs& a) {
    const int nb = a.nb;
    for (int i = 0; i < a.ntok; ++i) {
        size_t j = a.xidx ? (size_t)a.xidx[i] : (size_t)i;
        const int8_t* xq = a.xq + j * nb * QK;
        const float* xd = a.xd + j * nb;
        const float* xs = a.xs + j * nb;
        float* y = a.y + i * a.y_row;
        int r = 0;
        for (; r + 4 <= a.nrows; r += 4) {
            const uint8_t* w0 = a.w + r * a.w_row;
            const uint8_t* w1 = w0 + a.w_row;
            const uint8_t* w2 = w1 + a.w_row;
            const uint8_t* w3 = w2 + a.w_row;
            const uint16_t* s0 = a.ws + (size_t)r * nb;
            __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
            __m128 corr = _mm_setzero_ps();
            for (int b = 0; b < nb; ++b) {
                __m256i xv = _mm256_loadu_si256((const __m256i*)(xq + b * QK));
                __m128 dw = _mm_cvtph_ps(_mm_setr_epi16((short)s0[b], (short)s0[nb + b], (short)s0[2 * nb + b],
                                                       (short)s0[3 * nb + b], 0, 0, 0, 0));
                __m128 dwx = _mm_mul_ps(dw, _mm_set1_ps(xd[b]));
                acc0 = _mm256_fmadd_ps(_mm256_set1_ps(_mm_cvtss_f32(dwx)), block_dot<FMT>(w0, b, xv), acc0);
                acc1 = _mm256_fmadd_ps(_mm256_set1_ps(_mm_cvtss_f32(_mm_shuffle_ps(dwx, dwx, 1))),
                                       block_dot<FMT>(w1, b, xv), acc1);
                acc2 = _mm256_fmadd_ps(_mm256_set1_ps(_mm_cvtss_f32(_mm_shuffle_ps(dwx, dwx, 2))),
                                       block_dot<FMT>(w2, b, xv), acc2);
                acc3 = _mm256_fmadd_ps(_mm256_set1_ps(_mm_cvtss_f32(_mm_shuffle_ps(dwx, dwx, 3))),
                                       block_dot<FMT>(w3, b, xv), acc3);
                if (FMT == FMT_INT4) corr = _mm_fmadd_ps(dw, _mm_set1_ps(xs[b]), corr);
            }
            float c[4] = {0.f, 0.f, 0.f, 0.f};
            if (FMT == FMT_INT4) _mm_storeu_ps(c, _mm_mul_ps(corr, _mm_set1_ps(8.f)));
            y[r] = hsum(acc0) - c[0];
            y[r + 1] = hsum(acc1) - c[1];
            y[r + 2] = hsum(acc2) - c[2];
            y[r + 3] = hsum(acc3) - c[3];
        }
        for (; r < a.nrows; ++r) {
            const uint8_t* w0 = a.w + r * a.w_row;
            const uint16_t* s0 = a.ws + (size_t)r * nb;
            __m256 acc = _mm256_setzero_ps();
            float corr = 0.f;
            for (int b = 0; b < nb; ++b) {
                __m256i xv = _mm256_loadu_si256((const __m256i*)(xq + b * QK));
                float dw = _cvtsh_ss(s0[b]);
                acc = _mm256_fmadd_ps(_mm256_set1_ps(dw * xd[b]), block_dot<FMT>(w0, b, xv), acc);
                if (FMT == FMT_INT4) corr += dw * xs[b];
            }
            y[r] = hsum(acc) - 8.f * corr;
        }
    }
}

MOERUN_AVX2 void gemm_q4_avx2(const GemmArgs& a) { gemm_avx2<FMT_INT4>(a); }
MOERUN_AVX2 void gemm_q8_avx2(const GemmArgs& a) { gemm_avx2<FMT_INT8>(a); }

}  // namespace

const KernelTable avx2_kernels = {"avx2", quantize_row_avx2, gemm_q4_avx2, gemm_q8_avx2};

}  // namespace moerun
