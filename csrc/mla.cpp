// DeepSeek-V3's attention half (MLA) for a few tokens as one call: mla_block_decode (ops.h).
// The cache keeps one joined row [latent (R) | roped shared key (Dr)] per position, so the
// attention core is attn_decode's with one kv head of R + Dr whose values are the first R of
// each row: every ISA's attention kernel runs it as it is. The absorbed products (W_kb into
// the query, W_vb into the output) are N small per-head products each way, one pool task a
// head, on the ISA's float kernels.
#include <algorithm>
#include <vector>

#include "kernels.h"
#include "ops.h"
#include "thread_pool.h"

namespace moerun {
namespace {

struct MlaWork {
    std::vector<float> normed, proj, cq, q, qj, olat, att;
};
MlaWork& mla_work() {  // one op at a time (bindings hold a mutex)
    static MlaWork* w = new MlaWork();
    return *w;
}

// [x0, x1, x2, x3, ...] -> [x0, x2, ..., x1, x3, ...] (the module's interleaved pairs, made halves)
void deinterleave(float* x, int rd) {
    float tmp[512];
    const int h = rd / 2;
    for (int i = 0; i < h; ++i) {
        tmp[i] = x[2 * i];
        tmp[h + i] = x[2 * i + 1];
    }
    std::copy(tmp, tmp + rd, x);
}

void rope(bool interleaved, float* x, const float* cos, const float* sin, int rd) {
    if (interleaved) deinterleave(x, rd);
    head_rope(x, cos, sin, rd);
}

void add_bias(float* y, const float* b, int T, int n, int ld) {
    if (!b) return;
    for (int t = 0; t < T; ++t)
        for (int i = 0; i < n; ++i) y[(size_t)t * ld + i] += b[i];
}

// N per-head float products: y_n[t] = W_n x_n[t] (W_n [rows, in] at w + n * w_head bytes), each
// head one task; x_n[t] at x + n * x_head + t * x_row, y_n[t] at y + n * y_head + t * y_row
void per_head(int fmt, int N, int T, int rows, int in, const uint8_t* w, size_t w_head, const float* x, size_t x_head,
              size_t x_row, float* y, size_t y_head, size_t y_row) {
    const KernelTable& k = kern();
    const size_t rb = weight_row_bytes(fmt, in);
    pool().parallel_for(N, [&](int n) {
        GemmArgs a;
        a.nrows = rows;
        a.nb = blocks_of(in);
        a.w = w + n * w_head;
        a.w_row = rb;
        a.ws = nullptr;
        a.ntok = T;
        a.xidx = nullptr;
        a.in = in;
        a.xf = x + n * x_head;
        a.x_row = x_row;
        a.y = y + n * y_head;
        a.y_row = y_row;
        if (fmt == FMT_BF16)
            k.gemm_bf16(a);
        else
            k.gemm_f32(a);
    });
}

}  // namespace

void mla_block_decode(const MlaArgs& a, const float* x, float* out) {
    MlaWork& W = mla_work();
    const int T = a.T, H = a.H, N = a.N, R = a.R, Dr = a.Dr, Dn = a.Dn, Dv = a.Dv, J = R + Dr;
    const bool rb = a.half.round_bf16;  // a bf16 model (with or without `has_half`)
    const int nqk = N * (Dn + Dr);
    const float* x_in = x;
    if (a.has_half) {
        W.normed.resize((size_t)T * H);
        half_input(rb, T, H, x, a.half.norm_w, a.half.offset, a.half.eps, W.normed.data());
        x = W.normed.data();
    }
    // q_a (or q_proj) and kv_a read the same x: one job. Row t: [q_a's Q (or q's nqk) | kv_a's R + Dr]
    const int nq0 = a.Q > 0 ? a.Q : nqk, ld = nq0 + J;
    W.proj.resize((size_t)T * ld);
    const QWeight first[2] = {a.qa, a.kva};
    const int rows[2] = {nq0, J};
    qlinear_multi(T, H, 2, first, rows, x, W.proj.data());
    add_bias(W.proj.data(), a.qa_bias, T, nq0, ld);
    add_bias(W.proj.data() + nq0, a.kva_bias, T, J, ld);
    round_bf16_if(rb, W.proj.data(), W.proj.size());
    const float* q;  // [T, N, Dn + Dr], row stride q_ld
    size_t q_ld;
    if (a.Q > 0) {
        W.cq.resize((size_t)T * a.Q);
        for (int t = 0; t < T; ++t)
            rms_norm(1, a.Q, W.proj.data() + (size_t)t * ld, a.q_norm, 0.f, a.q_eps, W.cq.data() + (size_t)t * a.Q);
        round_bf16_if(rb, W.cq.data(), W.cq.size());
        W.q.resize((size_t)T * nqk);
        qlinear_multi(T, a.Q, 1, &a.qb, &nqk, W.cq.data(), W.q.data());
        round_bf16_if(rb, W.q.data(), W.q.size());
        q = W.q.data();
        q_ld = nqk;
    } else {
        q = W.proj.data();
        q_ld = ld;
    }
    // each token's cache row: the normed latent and the roped shared key
    const size_t esz = a.kv_type == KV_BF16 ? 2 : 4;
    for (int t = 0; t < T; ++t) {
        float* kv = W.proj.data() + (size_t)t * ld + nq0;
        rms_norm(1, R, kv, a.kv_norm, 0.f, a.kv_eps, kv);
        rope(a.interleaved, kv + R, a.cos + (size_t)t * Dr, a.sin + (size_t)t * Dr, Dr);
        round_bf16_if(rb, kv, J);
        char* row = (char*)a.c + (a.row_off[t] + (long)a.row_pos[t] * J) * esz;
        if (a.kv_type == KV_BF16) {
            uint16_t* r = (uint16_t*)row;
            for (int i = 0; i < J; ++i) r[i] = bf16_bits(kv[i]);
        } else {
            std::copy(kv, kv + J, (float*)row);
        }
    }
    const int f = a.first_out, Tw = T - f;
    if (Tw <= 0) return;
    // the queries [Tw, N, R + Dr]: q_lat = W_kb^T q_nope, then the roped q_rot
    W.qj.resize((size_t)Tw * N * J);
    const size_t wsz = a.wfmt == FMT_BF16 ? 2 : 4;
    per_head(a.wfmt, N, Tw, R, Dn, a.wkb, (size_t)R * Dn * wsz, q + (size_t)f * q_ld, Dn + Dr, q_ld, W.qj.data(), J,
             (size_t)N * J);
    for (int t = 0; t < Tw; ++t)
        for (int n = 0; n < N; ++n) {
            float* qn = W.qj.data() + ((size_t)t * N + n) * J;
            round_bf16_if(rb, qn, R);
            const float* src = q + (size_t)(f + t) * q_ld + (size_t)n * (Dn + Dr) + Dn;
            std::copy(src, src + Dr, qn + R);
            rope(a.interleaved, qn + R, a.cos + (size_t)(f + t) * Dr, a.sin + (size_t)(f + t) * Dr, Dr);
            round_bf16_if(rb, qn + R, Dr);
        }
    // each token's attention over its row's positions 0..p: out_lat [N, R]
    W.olat.resize((size_t)Tw * N * R);
    for (int t = 0; t < Tw; ++t) {
        const char* row = (const char*)a.c + a.row_off[f + t] * esz;
        attn_decode(N, 1, a.row_pos[f + t] + 1, J, R, W.qj.data() + (size_t)t * N * J, row, 0, J, row, 0, J, a.scale,
                    W.olat.data() + (size_t)t * N * R, a.kv_type);
    }
    round_bf16_if(rb, W.olat.data(), W.olat.size());
    // out[n] = W_vb[n] out_lat[n], [Tw, N * Dv]
    W.att.resize((size_t)Tw * N * Dv);
    per_head(a.wfmt, N, Tw, Dv, R, a.kvb + (size_t)Dn * R * wsz, (size_t)(Dn + Dv) * R * wsz, W.olat.data(), R,
             (size_t)N * R, W.att.data(), Dv, (size_t)N * Dv);
    round_bf16_if(rb, W.att.data(), W.att.size());
    float* y = out + (size_t)f * H;
    qlinear_multi(Tw, N * Dv, 1, &a.o, &H, W.att.data(), y);
    add_bias(y, a.o_bias, Tw, H, H);
    if (a.has_half) half_output(rb, x_in + (size_t)f * H, y, y, (size_t)Tw * H);
}

}  // namespace moerun
