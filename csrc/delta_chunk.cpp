// The chunked gated delta rule (Gated DeltaNet's prefill): csrc/delta_chunk.inc compiled once
// per ISA in a namespace of its own (generic: the baseline's 128-bit vectors; avx2: 256-bit;
// avx512: 512-bit, on CPUs with AVX-512F), picked by the kernel table in use (kern()), so that
// forcing an ISA (set_isa, MOERUN_ISA) forces this op's path too. Each function carries its
// target attribute and the .inc uses no library templates: no ISA's code reaches another path
// through the linker's choice of one copy of an inline function.
//
// delta_rule_chunked is the op on its own (q, k, v, g, beta as chunk_gated_delta_rule takes
// them); deltanet_decode (csrc/deltanet.cpp) calls delta_chunk_head for a long pass.
#include <math.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "ops.h"
#include "thread_pool.h"

namespace moerun {

namespace dc_generic {
namespace {
#define MOERUN_TARGET
#define DC_VBYTES 16
#define DC_ROWS 4
#define DC_NV 2
#include "delta_chunk.inc"
#undef MOERUN_TARGET
#undef DC_VBYTES
#undef DC_ROWS
#undef DC_NV
}  // namespace
void run(const DeltaChunkArgs& a) { chunk_head(a); }
void silu(float* y, long n) { silu_row(y, n); }
}  // namespace dc_generic

namespace dc_avx2 {
namespace {
#define MOERUN_TARGET __attribute__((target("avx2,fma")))
#define DC_VBYTES 32
#define DC_ROWS 4
#define DC_NV 3
#include "delta_chunk.inc"
#undef MOERUN_TARGET
#undef DC_VBYTES
#undef DC_ROWS
#undef DC_NV
}  // namespace
__attribute__((target("avx2,fma"))) void run(const DeltaChunkArgs& a) { chunk_head(a); }
__attribute__((target("avx2,fma"))) void silu(float* y, long n) { silu_row(y, n); }
}  // namespace dc_avx2

namespace dc_avx512 {
namespace {
#define MOERUN_TARGET __attribute__((target("avx2,fma,avx512f")))
#define DC_VBYTES 64
#define DC_ROWS 8
#define DC_NV 2
#include "delta_chunk.inc"
#undef MOERUN_TARGET
#undef DC_VBYTES
#undef DC_ROWS
#undef DC_NV
}  // namespace
__attribute__((target("avx2,fma,avx512f"))) void run(const DeltaChunkArgs& a) { chunk_head(a); }
__attribute__((target("avx2,fma,avx512f"))) void silu(float* y, long n) { silu_row(y, n); }
}  // namespace dc_avx512

size_t delta_chunk_scratch(int Dk, int Dv) {
    const size_t L = kDeltaChunk;
    return (size_t)Dk * L + 2 * L * L + 2 * L * (size_t)Dv + L;
}

void delta_chunk_head(const DeltaChunkArgs& a) {
    // the kernel tables by name: generic; avx2 and avxvnni (256-bit); the AVX-512 ones
    const char* isa = kern().name;
    if (!std::strcmp(isa, "generic"))
        dc_generic::run(a);
    else if (!std::strcmp(isa, "avx2") || !std::strcmp(isa, "avxvnni"))
        dc_avx2::run(a);
    else
        dc_avx512::run(a);
}

void silu_rows(float* y, long n) {
    const char* isa = kern().name;
    if (!std::strcmp(isa, "generic"))
        dc_generic::silu(y, n);
    else if (!std::strcmp(isa, "avx2") || !std::strcmp(isa, "avxvnni"))
        dc_avx2::silu(y, n);
    else
        dc_avx512::silu(y, n);
}

void delta_rule_chunked(int B, int T, int Hk, int Hv, int Dk, int Dv, const float* q, const float* k, const float* v,
                        const float* g, const float* beta, float* S, float* out) {
    // q and k L2-normalised (x * rsqrt(sum x^2 + 1e-6)), q also times Dk^-0.5, as
    // kernels.reference._prepare does; then g and beta per (row, value head) contiguous
    static std::vector<float>* work = new std::vector<float>();  // one op at a time (the op lock)
    const size_t nqk = (size_t)B * T * Hk * Dk, ng = (size_t)B * Hv * T;
    work->resize(2 * nqk + 2 * ng);
    float* qn = work->data();
    float* kn = qn + nqk;
    float* gh = kn + nqk;
    float* bh = gh + ng;
    const float qscale = 1.f / std::sqrt((float)Dk);
    pool().parallel_for(B * T, [&](int bt) {
        for (int which = 0; which < 2; ++which) {
            const float* src = (which ? k : q) + (size_t)bt * Hk * Dk;
            float* dst = (which ? kn : qn) + (size_t)bt * Hk * Dk;
            for (int h = 0; h < Hk; ++h) {
                float ss = 0.f;
                for (int i = 0; i < Dk; ++i) ss += src[h * Dk + i] * src[h * Dk + i];
                float r = 1.f / std::sqrt(ss + 1e-6f);
                if (!which) r *= qscale;
                for (int i = 0; i < Dk; ++i) dst[h * Dk + i] = src[h * Dk + i] * r;
            }
        }
    });
    for (int b = 0; b < B; ++b)
        for (int t = 0; t < T; ++t)
            for (int h = 0; h < Hv; ++h) {
                const size_t i = ((size_t)b * Hv + h) * T + t, src = ((size_t)b * T + t) * Hv + h;
                gh[i] = g[src];
                bh[i] = beta[src];
            }
    const int per_k = Hv / Hk;
    const size_t SS = (size_t)Dk * Dv;
    pool().parallel_for(B * Hv, [&](int task) {
        const int b = task / Hv, h = task % Hv, hk = h / per_k;
        std::vector<float> scratch(delta_chunk_scratch(Dk, Dv));
        DeltaChunkArgs d;
        d.T = T;
        d.Dk = Dk;
        d.Dv = Dv;
        d.q = qn + (size_t)b * T * Hk * Dk + (size_t)hk * Dk;
        d.k = kn + (size_t)b * T * Hk * Dk + (size_t)hk * Dk;
        d.x_st = (long)Hk * Dk;
        d.g = gh + (size_t)task * T;
        d.beta = bh + (size_t)task * T;
        d.S = d.S_out = S + (size_t)task * SS;
        d.o = out + (size_t)b * T * Hv * Dv + (size_t)h * Dv;
        d.o_st = (long)Hv * Dv;
        d.scratch = scratch.data();
        d.v = v + (size_t)b * T * Hv * Dv + (size_t)h * Dv;
        d.v_st = (long)Hv * Dv;
        delta_chunk_head(d);
    });
}

}  // namespace moerun
