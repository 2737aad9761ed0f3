// The AMX table: the AVX-512 VNNI kernels, with the int4 / int8 GEMM of tiles of 16 or more
// tokens (prefill) on AMX tiles. Only reached through kernels_for() / best_kernels() after the
// CPU was checked and Linux granted this process the tile data state (kernels_generic.cpp).
//
// One TDPBUSD (int4: unsigned weights q + 8 against signed activations) or TDPBSSD (int8)
// multiplies a 16-row x 32-byte A tile (one block of 16 weight rows) by an 8 x 64-byte B tile
// (the same block of 16 tokens, 4 bytes of each per row: AMX's layout for B) into 16 x 16
// int32 dot products: 8192 multiply-adds, exact. Each block has its own scales, so every
// block's products are taken out (tile store) and applied in float32 exactly as the 256- and
// 512-bit kernels apply them: per (row, token) and group of 8 blocks, lane j block j,
// p = d_x * dot - 8 * d_x * sum(x) (int4) or d_x * dot (int8), acc_j = fma(p, d_w, acc_j);
// then the lanes summed in hsum's order and the tail blocks (nb % 8) added by gemm_tail. So a
// token's result is bit-identical to what a decode step computes for it alone.
//
// The weights and activations are stored with the 4-byte words of each group of 8 blocks
// interleaved (kernels.h); for the tiles they are put back in block order in scratch
// buffers: a tile's 16 tokens once per group, a tile's 16 rows once per group and token tile.
#include <immintrin.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <new>

#include "kernels.h"

#define MOERUN_DOT(u, x) MOERUN_DPBUSD(_mm256_setzero_si256(), u, x)
#define MOERUN_ACC4(acc, ulo, xlo, uhi, xhi) MOERUN_DPBUSD(MOERUN_DPBUSD(acc, ulo, xlo), uhi, xhi)
#define MOERUN_ACC4_I32(acc) (acc)
#define MOERUN_ACC8(acc, u, x) MOERUN_DPBUSD(acc, u, x)
#define MOERUN_TARGET __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni,amx-tile,amx-int8")))
#define MOERUN_DPBUSD _mm256_dpbusd_epi32
#define MOERUN_VECTOR_REGS 32

namespace moerun {
namespace amx {
namespace {
#include "kernels_x86.inc"
#include "kernels_zmm.inc"
#include "kernels_raw.inc"  // the raw formats: the 512-bit tables' kernels, no tiles

constexpr int kMinTokens = 16;  // fewer tokens in a tile: the 512-bit kernel

// The tile configuration (palette 1), two blocks in flight: tiles 0 and 1 the 16 x 16 int32
// products (C), tiles 2 and 3 a block of 16 weight rows (A: 16 rows x 32 bytes), tiles 4 and 5
// the block of 16 tokens (B: 8 rows x 64 bytes). In read-only data: a configuration built on
// the stack can be optimised away before LDTILECFG reads it.
struct alignas(64) TileConfig {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};
constexpr TileConfig kConfig = {1, 0, {}, {64, 64, 32, 32, 64, 64}, {16, 16, 16, 16, 8, 8}};

// One group's weights of one row (kGroupBytes, interleaved) -> 8 blocks of 32 bytes in element
// order at dst + j * dst_stride (int4: as unsigned nibbles q + 8).
template <int FMT>
MOERUN_TARGET inline void weight_group(const uint8_t* w, uint8_t* dst, size_t dst_stride) {
    __m256i r[8];
    if (FMT == FMT_INT4) {
        for (int k = 0; k < 4; ++k) r[k] = _mm256_loadu_si256((const __m256i*)(w + 32 * k));
        for (int k = 4; k < 8; ++k) r[k] = _mm256_setzero_si256();
        transpose8_epi32(r);  // r[j]: words 0-3 of block j (its 16 bytes), then zeros
        const __m128i m4 = _mm_set1_epi8(0x0f);
        for (int j = 0; j < 8; ++j) {
            const __m128i raw = _mm256_castsi256_si128(r[j]);
            _mm256_storeu_si256((__m256i*)(dst + j * dst_stride),
                                _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), m4), _mm_and_si128(raw, m4)));
        }
    } else {
        for (int k = 0; k < 8; ++k) r[k] = _mm256_loadu_si256((const __m256i*)(w + 32 * k));
        transpose8_epi32(r);  // r[j]: block j's 8 words
        for (int j = 0; j < 8; ++j) _mm256_storeu_si256((__m256i*)(dst + j * dst_stride), r[j]);
    }
}

// One group of 16 tokens' activations (each 256 bytes, interleaved; nullptr: a token past the
// tile's end, zeros) -> 8 B tiles at dst + j * 512: row k holds word k of block j of tokens
// 0..15.
MOERUN_TARGET inline void token_group(const int8_t* const* x, uint8_t* dst) {
    for (int k = 0; k < 8; ++k)
        for (int half = 0; half < 2; ++half) {
            __m256i r[8];
            for (int t = 0; t < 8; ++t) {
                const int8_t* p = x[8 * half + t];
                r[t] = p ? _mm256_loadu_si256((const __m256i*)(p + 32 * k)) : _mm256_setzero_si256();
            }
            transpose8_epi32(r);  // r[j]: word k of block j for these 8 tokens
            for (int j = 0; j < 8; ++j) _mm256_storeu_si256((__m256i*)(dst + j * 512 + k * 64 + 32 * half), r[j]);
        }
}

// Scratch kept per thread between calls (malloc'ed: no library templates in this file).
struct Scratch {
    uint8_t* p = nullptr;
    size_t n = 0;
    ~Scratch() { free(p); }  // a pool thread's, when the pool is resized
    uint8_t* get(size_t want) {
        if (want > n) {
            free(p);
            p = (uint8_t*)aligned_alloc(64, (want + 63) / 64 * 64);
            n = p ? want : 0;
        }
        return p;
    }
};
thread_local Scratch t_scratch;

template <int FMT>
MOERUN_TARGET void gemm_amx(const GemmArgs& a) {
    const int nb = a.nb, ng = nb / 8;
    if (a.ntok < kMinTokens || ng == 0) {
        gemm_all_zmm<FMT>(a);
        return;
    }
    constexpr int kBlockBytes = FMT == FMT_INT4 ? QK / 2 : QK;
    constexpr int kGroupBytes = 8 * kBlockBytes;
    const int ntt = (a.ntok + 15) / 16;  // token tiles
    // scratch: B tiles [ntt][ng][8 blocks][512]; A tiles [8 blocks][16 rows][32]; the products
    // C [8 blocks][16 rows][16 tokens] (int32) and the group's weight scales [16 rows][8 blocks];
    // per token tile the activation scales by block [nb][16] (d_x, then 8 * d_x * sum) and the
    // float sums [16 rows][8 lanes][16 tokens]
    const size_t b_bytes = (size_t)ntt * ng * 8 * 512, a_bytes = 8 * 16 * 32, c_bytes = 8 * 16 * 16 * 4 + 8 * 16 * 4;
    const size_t s_bytes = (size_t)ntt * nb * 16 * 4 * 2, acc_bytes = (size_t)ntt * 16 * 8 * 16 * 4;
    uint8_t* base = t_scratch.get(b_bytes + a_bytes + c_bytes + s_bytes + acc_bytes);
    if (!base) {
        gemm_all_zmm<FMT>(a);
        return;
    }
    uint8_t* B = base;
    uint8_t* A = B + b_bytes;
    int32_t* C = (int32_t*)(A + a_bytes);
    float* dwf = (float*)(C + 8 * 16 * 16);
    float* dxT = (float*)((uint8_t*)C + c_bytes);
    float* xsT = dxT + (size_t)ntt * nb * 16;
    float* acc = xsT + (size_t)ntt * nb * 16;

    const __m512 eight = _mm512_set1_ps(8.f);
    for (int tt = 0; tt < ntt; ++tt) {
        const int8_t* xq[16];
        for (int t = 0; t < 16; ++t) {
            const int i = 16 * tt + t;
            if (i < a.ntok) {
                const size_t row = a.xidx ? (size_t)a.xidx[i] : (size_t)i;
                xq[t] = a.xq + row * nb * QK;
                for (int b = 0; b < nb; ++b) {
                    dxT[((size_t)tt * nb + b) * 16 + t] = a.xd[row * nb + b];
                    xsT[((size_t)tt * nb + b) * 16 + t] = a.xs[row * nb + b];
                }
            } else {
                xq[t] = nullptr;
                for (int b = 0; b < nb; ++b) dxT[((size_t)tt * nb + b) * 16 + t] = xsT[((size_t)tt * nb + b) * 16 + t] = 0.f;
            }
        }
        for (int b = 0; b < nb; ++b) {  // 8 * d_x * sum(q_x), as the other kernels round it
            float* s = xsT + ((size_t)tt * nb + b) * 16;
            _mm512_storeu_ps(s, _mm512_mul_ps(eight, _mm512_loadu_ps(s)));
        }
        for (int g = 0; g < ng; ++g) {
            const int8_t* xg[16];
            for (int t = 0; t < 16; ++t) xg[t] = xq[t] ? xq[t] + (size_t)g * 8 * QK : nullptr;
            token_group(xg, B + ((size_t)tt * ng + g) * 8 * 512);
        }
    }

    _tile_loadconfig(&kConfig);
    for (int r0 = 0; r0 < a.nrows; r0 += 16) {
        const int nr = a.nrows - r0 < 16 ? a.nrows - r0 : 16;
        if (nr < 16) memset(A, 0, a_bytes);
        memset(acc, 0, acc_bytes);
        for (int g = 0; g < ng; ++g) {
            // the next group of these rows (or the first of the next 16) is fetched while this
            // one's tiles compute: 16 rows at a row's stride are 16 streams, which the hardware
            // prefetcher does not follow
            const int nx = g + 1 < ng ? r0 : r0 + 16, gx = g + 1 < ng ? g + 1 : 0;
            for (int m = 0; m < 16 && nx + m < a.nrows; ++m) {
                const char* p = (const char*)(a.w + (size_t)(nx + m) * a.w_row + (size_t)gx * kGroupBytes);
                for (int l = 0; l < kGroupBytes; l += 64) _mm_prefetch(p + l, _MM_HINT_T0);
            }
            for (int m = 0; m < nr; ++m) {
                weight_group<FMT>(a.w + (size_t)(r0 + m) * a.w_row + (size_t)g * kGroupBytes, A + m * 32, 16 * 32);
                _mm256_storeu_ps(dwf + m * 8, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(a.ws + (size_t)(r0 + m) * nb + 8 * g))));
            }
            for (int tt = 0; tt < ntt; ++tt) {
                const uint8_t* Bg = B + ((size_t)tt * ng + g) * 8 * 512;
                for (int j = 0; j < 8; j += 2) {  // two blocks' products at a time, then their scales
                    _tile_zero(0);
                    _tile_zero(1);
                    _tile_loadd(2, A + j * 16 * 32, 32);
                    _tile_loadd(3, A + (j + 1) * 16 * 32, 32);
                    _tile_loadd(4, Bg + j * 512, 64);
                    _tile_loadd(5, Bg + (j + 1) * 512, 64);
                    if (FMT == FMT_INT4) {
                        _tile_dpbusd(0, 2, 4);
                        _tile_dpbusd(1, 3, 5);
                    } else {
                        _tile_dpbssd(0, 2, 4);
                        _tile_dpbssd(1, 3, 5);
                    }
                    _tile_stored(0, C + j * 256, 64);
                    _tile_stored(1, C + (j + 1) * 256, 64);
                }
                float* acc_t = acc + (size_t)tt * 16 * 8 * 16;
                for (int j = 0; j < 8; ++j) {
                    const int b = 8 * g + j;
                    const __m512 dx = _mm512_loadu_ps(dxT + ((size_t)tt * nb + b) * 16);
                    const __m512 sx = _mm512_loadu_ps(xsT + ((size_t)tt * nb + b) * 16);
                    for (int m = 0; m < nr; ++m) {
                        const __m512 c = _mm512_cvtepi32_ps(_mm512_loadu_si512((const void*)(C + j * 256 + m * 16)));
                        const __m512 p = FMT == FMT_INT4 ? _mm512_fmsub_ps(c, dx, sx) : _mm512_mul_ps(c, dx);
                        float* s = acc_t + (m * 8 + j) * 16;
                        _mm512_storeu_ps(s, _mm512_fmadd_ps(p, _mm512_set1_ps(dwf[m * 8 + j]), _mm512_loadu_ps(s)));
                    }
                }
            }
        }
        // per (row, token): the 8 lanes in hsum's order, then the tail blocks as gemm_tail adds
        // them; written a token at a time (its rows are contiguous in y)
        float* sums = (float*)C;  // [16 rows][16 tokens], the products are used up
        for (int tt = 0; tt < ntt; ++tt) {
            const float* acc_t = acc + (size_t)tt * 16 * 8 * 16;
            for (int m = 0; m < nr; ++m) {
                const float* l = acc_t + m * 8 * 16;
                _mm512_storeu_ps(sums + m * 16, _mm512_add_ps(
                    _mm512_add_ps(_mm512_add_ps(_mm512_loadu_ps(l + 0 * 16), _mm512_loadu_ps(l + 4 * 16)),
                                  _mm512_add_ps(_mm512_loadu_ps(l + 2 * 16), _mm512_loadu_ps(l + 6 * 16))),
                    _mm512_add_ps(_mm512_add_ps(_mm512_loadu_ps(l + 1 * 16), _mm512_loadu_ps(l + 5 * 16)),
                                  _mm512_add_ps(_mm512_loadu_ps(l + 3 * 16), _mm512_loadu_ps(l + 7 * 16)))));
            }
            for (int t = 0; t < 16 && 16 * tt + t < a.ntok; ++t) {
                const int i = 16 * tt + t;
                float* y = a.y + (size_t)i * a.y_row + r0;
                const int8_t* xq;
                const float *xd, *xs;
                token_rows<1>(a, i, &xq, &xd, &xs);
                for (int m = 0; m < nr; ++m) {
                    float tail = 0.f;  // added whether or not there are tail blocks, as gemm_row adds it
                    if (nb % 8) gemm_tail<FMT, 1>(a, a.w + (size_t)(r0 + m) * a.w_row, a.ws + (size_t)(r0 + m) * nb, &xq, &xd, &xs, &tail);
                    y[m] = sums[m * 16 + t] + tail;
                }
            }
        }
    }
    _tile_release();
}

MOERUN_TARGET void gemm_q4_amx(const GemmArgs& a) { gemm_amx<FMT_INT4>(a); }
MOERUN_TARGET void gemm_q8_amx(const GemmArgs& a) { gemm_amx<FMT_INT8>(a); }

}  // namespace
}  // namespace amx

// bf16 weight rows as avx512bf16 runs them where the CPU has AVX512_BF16, else the FMA path
static void gemm_bf16_amx(const GemmArgs& a) {
    static const bool dp = cpu_has_avx512bf16();
    if (dp)
        gemm_bf16_dp(a);
    else
        amx::gemm_bf16(a);
}

const KernelTable amx_kernels = {"amx", amx::quantize_row, amx::gemm_q4_amx, amx::gemm_q8_amx, amx::attn_chunk_zmm,
                                 amx::delta_head, amx::gemm_f32, gemm_bf16_amx, amx::gemm_raw};

}  // namespace moerun
