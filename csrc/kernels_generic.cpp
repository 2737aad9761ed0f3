// Portable kernels: plain C++ for any x86-64 (or other) CPU, and the ISA dispatch point.
#include <cmath>
#include <cstddef>
#include <cstring>
#include <cpuid.h>
#ifdef __linux__
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "kernels.h"

namespace moerun {

float fp16_to_fp32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else {  // subnormal: renormalise
            exp = 127 - 15 + 1;
            while (!(man & 0x400)) { man <<= 1; --exp; }
            bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

namespace {

void quantize_row_generic(const float* x, int n, int nb, int8_t* q, float* d, float* s) {
    for (int b = 0; b < nb; ++b) {
        int lo = b * QK, hi = lo + QK < n ? lo + QK : n;
        float amax = 0.f;
        for (int i = lo; i < hi; ++i) amax = std::fmax(amax, std::fabs(x[i]));
        float dd = amax / 127.f, id = amax > 0.f ? 1.f / dd : 0.f;
        int sum = 0;
        for (int j = 0; j < QK; ++j) {
            int i = lo + j;
            int v = i < hi ? (int)std::nearbyint(x[i] * id) : 0;
            q[lo + j] = (int8_t)v;
            sum += v;
        }
        d[b] = dd;
        s[b] = dd * (float)sum;
    }
}

inline const float* xrow_d(const GemmArgs& a, int i, const int8_t** xq, const float** xs) {
    size_t j = a.xidx ? (size_t)a.xidx[i] : (size_t)i;
    *xq = a.xq + j * a.nb * QK;
    *xs = a.xs + j * a.nb;
    return a.xd + j * a.nb;
}

// Byte j of block b of a weight row of nb blocks of `bytes` bytes: blocks in the row's whole
// groups of 8 have their 4-byte words interleaved (word k of block b % 8 at word k * 8 + b % 8
// of the group), the last nb % 8 blocks are natural. This path's activations stay natural.
inline size_t wbyte(int b, int j, int nb, int bytes) {
    if (b >= nb / 8 * 8) return (size_t)b * bytes + j;
    return (size_t)(b / 8) * 8 * bytes + ((j / 4) * 8 + b % 8) * 4 + j % 4;
}

void gemm_q4_generic(const GemmArgs& a) {
    constexpr int kBytes = QK / 2;
    for (int i = 0; i < a.ntok; ++i) {
        const int8_t* xq;
        const float* xs;
        const float* xd = xrow_d(a, i, &xq, &xs);
        for (int r = 0; r < a.nrows; ++r) {
            const uint8_t* w = a.w + r * a.w_row;
            const uint16_t* ws = a.ws + (size_t)r * a.nb;
            float acc = 0.f;
            for (int b = 0; b < a.nb; ++b) {
                const int8_t* xb = xq + b * QK;
                int isum = 0;
                for (int j = 0; j < kBytes; ++j) {
                    const uint8_t v = w[wbyte(b, j, a.nb, kBytes)];
                    isum += (v & 0xf) * xb[j] + (v >> 4) * xb[j + kBytes];
                }
                // stored nibbles are q + 8: subtract 8 * sum(x) through the precomputed s
                acc += fp16_to_fp32(ws[b]) * (xd[b] * (float)isum - 8.f * xs[b]);
            }
            a.y[i * a.y_row + r] = acc;
        }
    }
}

void gemm_q8_generic(const GemmArgs& a) {
    for (int i = 0; i < a.ntok; ++i) {
        const int8_t* xq;
        const float* xs;
        const float* xd = xrow_d(a, i, &xq, &xs);
        for (int r = 0; r < a.nrows; ++r) {
            const int8_t* w = (const int8_t*)(a.w + r * a.w_row);
            const uint16_t* ws = a.ws + (size_t)r * a.nb;
            float acc = 0.f;
            for (int b = 0; b < a.nb; ++b) {
                const int8_t* xb = xq + b * QK;
                int isum = 0;
                for (int j = 0; j < QK; ++j) isum += w[wbyte(b, j, a.nb, QK)] * xb[j];
                acc += fp16_to_fp32(ws[b]) * xd[b] * (float)isum;
            }
            a.y[i * a.y_row + r] = acc;
        }
    }
}

inline uint32_t le32(const uint8_t* p) { return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24; }
inline float half_at(const uint8_t* p) { return fp16_to_fp32((uint16_t)(p[0] | p[1] << 8)); }

// One raw block (raw_block_elems(fmt) inputs) as unsigned quants q[] in element order and, per
// sub-block of `*sub` inputs, scale[] and offset[]: w_i = scale * q_i - offset.
void raw_block(int fmt, const uint8_t* b, uint8_t* q, float* scale, float* offset, int* sub) {
    if (fmt == FMT_Q5_0) {
        const float d = half_at(b);
        const uint32_t qh = le32(b + 2);
        for (int j = 0; j < 16; ++j) {
            q[j] = (uint8_t)((b[6 + j] & 0xf) | ((qh >> j) & 1) << 4);
            q[j + 16] = (uint8_t)((b[6 + j] >> 4) | ((qh >> (j + 16)) & 1) << 4);
        }
        scale[0] = d;
        offset[0] = 16.f * d;
        *sub = 32;
    } else if (fmt == FMT_Q6_K) {
        const uint8_t *ql = b, *qh = b + 128;
        const int8_t* sc = (const int8_t*)(b + 192);
        const float d = half_at(b + 208);
        for (int n = 0; n < 2; ++n)
            for (int l = 0; l < 32; ++l) {
                const int o = 128 * n;
                const uint8_t h = qh[32 * n + l], a = ql[64 * n + l], c = ql[64 * n + 32 + l];
                q[o + l] = (uint8_t)((a & 0xf) | (h & 3) << 4);
                q[o + 32 + l] = (uint8_t)((c & 0xf) | ((h >> 2) & 3) << 4);
                q[o + 64 + l] = (uint8_t)((a >> 4) | ((h >> 4) & 3) << 4);
                q[o + 96 + l] = (uint8_t)((c >> 4) | ((h >> 6) & 3) << 4);
            }
        for (int j = 0; j < 16; ++j) {
            scale[j] = d * (float)sc[j];
            offset[j] = 32.f * scale[j];
        }
        *sub = 16;
    } else {  // Q4_K, Q5_K: d, dmin, 12 bytes of 6-bit scales and mins, (Q5_K: 32 bytes of high bits), nibbles
        const float d = half_at(b), dmin = half_at(b + 2);
        const uint8_t* s = b + 4;
        const uint8_t* qs = b + (fmt == FMT_Q5_K ? 48 : 16);
        for (int j = 0; j < 8; ++j) {
            int sc, m;
            if (j < 4) {
                sc = s[j] & 63;
                m = s[j + 4] & 63;
            } else {
                sc = (s[j + 4] & 0xf) | (s[j - 4] >> 6) << 4;
                m = (s[j + 4] >> 4) | (s[j] >> 6) << 4;
            }
            scale[j] = d * (float)sc;
            offset[j] = dmin * (float)m;
            const uint8_t* c = qs + 32 * (j / 2);
            for (int l = 0; l < 32; ++l) {
                int v = j % 2 ? c[l] >> 4 : c[l] & 0xf;
                if (fmt == FMT_Q5_K) v |= ((b[16 + l] >> j) & 1) << 4;
                q[32 * j + l] = (uint8_t)v;
            }
        }
        *sub = 32;
    }
}

// Raw rows against natural int8 activations: per sub-block the integer dot product and the
// activations' integer sum, acc += d_x * (scale * dot - offset * sum).
void gemm_raw_generic(int fmt, const GemmArgs& a) {
    const int be = raw_block_elems(fmt), bb = raw_block_bytes(fmt), nblk = a.nb * QK / be;
    uint8_t q[256];
    float scale[16], offset[16];
    int sub;
    for (int i = 0; i < a.ntok; ++i) {
        const int8_t* xq;
        const float* xs;
        const float* xd = xrow_d(a, i, &xq, &xs);
        for (int r = 0; r < a.nrows; ++r) {
            const uint8_t* w = a.w + r * a.w_row;
            float acc = 0.f;
            for (int k = 0; k < nblk; ++k) {
                raw_block(fmt, w + (size_t)k * bb, q, scale, offset, &sub);
                for (int s0 = 0; s0 < be; s0 += sub) {
                    const int e0 = k * be + s0;
                    int dot = 0, sum = 0;
                    for (int l = 0; l < sub; ++l) {
                        dot += q[s0 + l] * xq[e0 + l];
                        sum += xq[e0 + l];
                    }
                    acc += xd[e0 / QK] * (scale[s0 / sub] * (float)dot - offset[s0 / sub] * (float)sum);
                }
            }
            a.y[i * a.y_row + r] = acc;
        }
    }
}

// element d of position s of a float32, bf16 or int8 (scaled) key/value row
inline float kv_at(int type, const void* base, const float* sc, long ss, long s_ss, int s, int d) {
    const long i = s * ss + d;
    if (type == KV_I8) return sc[s * s_ss] * (float)((const int8_t*)base)[i];
    if (type == KV_BF16) {
        uint32_t bits = (uint32_t)((const uint16_t*)base)[i] << 16;
        float f;
        std::memcpy(&f, &bits, 4);
        return f;
    }
    return ((const float*)base)[i];
}

// Float weight rows against float32 activations: 8 partial sums, then the tail
template <int WT>
void gemm_float_generic(const GemmArgs& a) {
    const int n = a.in;
    for (int i = 0; i < a.ntok; ++i) {
        const float* x = a.xf + (size_t)(a.xidx ? a.xidx[i] : i) * a.x_row;
        for (int r = 0; r < a.nrows; ++r) {
            const void* w = a.w + (size_t)r * a.w_row;
            float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
            int j = 0;
            for (; j + 8 <= n; j += 8)
                for (int u = 0; u < 8; ++u) acc[u] += kv_at(WT, w, nullptr, 0, 0, 0, j + u) * x[j + u];
            float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
            for (; j < n; ++j) s += kv_at(WT, w, nullptr, 0, 0, 0, j) * x[j];
            a.y[(size_t)i * a.y_row + r] = s;
        }
    }
}

void attn_chunk_generic(const AttnArgs& a) {
    for (int g = 0; g < a.G; ++g) {
        const float* q = a.q + (size_t)g * a.D;
        float* p = a.p + (size_t)g * a.n;
        float m = -INFINITY;
        for (int s = 0; s < a.n; ++s) {
            float acc = 0.f;
            for (int d = 0; d < a.D; ++d) acc += q[d] * kv_at(a.kv_type, a.k, a.k_scale, a.k_ss, a.ks_ss, s, d);
            p[s] = acc * a.scale;
            m = std::fmax(m, p[s]);
        }
        float l = 0.f;
        float* o = a.o + (size_t)g * a.Dv;
        for (int d = 0; d < a.Dv; ++d) o[d] = 0.f;
        for (int s = 0; s < a.n; ++s) {
            float e = std::exp(p[s] - m);
            l += e;
            for (int d = 0; d < a.Dv; ++d) o[d] += e * kv_at(a.kv_type, a.v, a.v_scale, a.v_ss, a.vs_ss, s, d);
        }
        a.m[g] = m;
        a.l[g] = l;
    }
}

#define MOERUN_TARGET
#include "delta_rule.inc"
#undef MOERUN_TARGET

}  // namespace

const KernelTable generic_kernels = {"generic", quantize_row_generic, gemm_q4_generic, gemm_q8_generic,
                                     attn_chunk_generic, delta_head, gemm_float_generic<KV_F32>,
                                     gemm_float_generic<KV_BF16>, gemm_raw_generic};

bool cpu_has_avx2() {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
}

static bool cpu_has_avx512vnni() {
    return cpu_has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512vnni");
}

// AMX tiles with int8 products, and Linux's leave to use them: the tile data state is off
// for a process until it asks (arch_prctl ARCH_REQ_XCOMP_PERM); asked once, here.
static bool cpu_has_amx() {
    static const bool ok = [] {
        if (!cpu_has_avx512vnni()) return false;
        unsigned a, b, c, d;
        if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 25))) return false;
        unsigned lo, hi;
        __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
        if ((lo & (3u << 17)) != (3u << 17)) return false;  // the OS keeps no tile state
#ifdef __linux__
        const long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
        if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) return false;
#endif
        return true;
    }();
    return ok;
}

bool cpu_has_avx512bf16() { return cpu_has_avx512vnni() && __builtin_cpu_supports("avx512bf16"); }

static bool cpu_has_avxvnni() { return cpu_has_avx2() && __builtin_cpu_supports("avxvnni"); }

// Every path this CPU can run, slowest first; the last is the default.
int supported_kernels(const KernelTable** out) {
    int n = 0;
    out[n++] = &generic_kernels;
    if (cpu_has_avx2()) out[n++] = &avx2_kernels;
    if (cpu_has_avxvnni()) out[n++] = &avxvnni_kernels;
    if (cpu_has_avx512vnni()) out[n++] = &avx512vnni_kernels;
    if (cpu_has_avx512bf16()) out[n++] = &avx512bf16_kernels;
    if (cpu_has_amx()) out[n++] = &amx_kernels;
    return n;
}

const KernelTable* kernels_for(const char* name) {
    const KernelTable* all[8];
    int n = supported_kernels(all);
    for (int i = 0; i < n; ++i)
        if (!std::strcmp(name, all[i]->name)) return all[i];
    return nullptr;
}

const KernelTable* best_kernels() {
    const KernelTable* all[8];
    return all[supported_kernels(all) - 1];
}

}  // namespace moerun
