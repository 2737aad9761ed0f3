// Gated DeltaNet (Qwen3-Next / Qwen3.5 linear attention) for a few tokens per row, token after
// token: the decode step, and a speculative verification pass that keeps every token's state.
// moerun/layers/deltanet.py is the reference (causal_conv1d, _prepare, _delta_update,
// gated_rms_norm); everything here runs in float32 in the same order of operations per token.
//
// Three phases, so each runs over independent work: (1) the causal conv + SiLU over every
// channel and token (channels are independent), (2) the L2 norm of each token's q and k heads,
// (3) the delta rule and gated RMSNorm per (row, value head), over the tokens in order — the
// only sequential part, run by the kernel table's delta_head (csrc/delta_rule.inc, vectorized
// for each ISA). It reads each head's [Dk, Dv] state once and writes it once per token: pass 1
// takes k S and q S from the old state, pass 2 writes decay * S + k^T delta (torch's version
// passes over the state three times).
#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels.h"
#include "ops.h"
#include "thread_pool.h"

namespace moerun {
namespace {

inline float softplus(float x) { return x > 20.f ? x : std::log1p(std::exp(x)); }  // torch's threshold

struct DeltaWork {
    std::vector<float> y;      // [B, T, C] conv outputs; q and k heads L2-normalised in place (q scaled)
    std::vector<float> gates;  // each (row, head, token)'s decay and beta
    std::vector<float> conv_ext;  // the conv's inputs position-major [K-1+T, C]
    std::vector<float> h, proj, o;  // deltanet_block_decode's normed input, projections and DeltaNet output
};
DeltaWork& delta_work() {  // one op at a time (bindings hold a mutex)
    static DeltaWork* w = new DeltaWork();
    return *w;
}

}  // namespace

void deltanet_decode(const DeltaArgs& a) {
    DeltaWork* work = &delta_work();
    const int B = a.B, T = a.T, C = a.C, K = a.K, Km = a.K - 1;
    const int kd = a.Hk * a.Dk;
    // a prompt (a long pass that keeps no per-token states, of a large enough state): the
    // chunked delta rule (delta_chunk_head), and the conv and q/k norms on the pool
    const bool chunked = delta_chunked(T, a.Hv, a.Dk, a.Dv, a.S_every != nullptr);
    std::vector<float>& y = work->y;
    y.resize((size_t)B * T * C);

    // (1) conv: window [state, x_t] . w, then SiLU; the state keeps the last K-1 inputs. Per
    // row, the channels' inputs are laid out position-major (`ext`: the K-1 states, then the T
    // tokens' inputs), and the weights come transposed ([K, C]), so that every loop runs over
    // contiguous channels (vectorized); each output's sum is the same ordered sum over the
    // window as channel by channel (which took ~10 us a layer for a 3-token pass of the demo
    // model, most of it moving the window and its copies).
    std::vector<float>& ext = work->conv_ext;
    ext.resize((size_t)(Km + T) * C);
    for (int b = 0; b < B; ++b) {
        const size_t rb = a.row_slot ? (size_t)a.row_slot[b] : (size_t)b;
        float* st = a.conv + rb * C * Km;  // [C, Km]
        for (int c = 0; c < C; ++c)
            for (int j = 0; j < Km; ++j) ext[(size_t)j * C + c] = st[(size_t)c * Km + j];
        for (int t = 0; t < T; ++t)
            std::copy(a.qkv + b * a.qkv_sb + t * a.qkv_st, a.qkv + b * a.qkv_sb + t * a.qkv_st + C,
                      ext.data() + (size_t)(Km + t) * C);
        auto token = [&](int t) {
            float* yt = y.data() + ((size_t)b * T + t) * C;
            for (int c = 0; c < C; ++c) yt[c] = 0.f;
            for (int j = 0; j < K; ++j) {
                const float* __restrict e = ext.data() + (size_t)(t + j) * C;
                const float* __restrict w = a.conv_w + (size_t)j * C;
                for (int c = 0; c < C; ++c) yt[c] += e[c] * w[c];
            }
            silu_rows(yt, C);
            if (a.conv_every) {  // the state after token t: its window's last K-1 inputs
                float* ev = a.conv_every + ((size_t)b * T + t) * C * Km;
                for (int c = 0; c < C; ++c)
                    for (int j = 0; j < Km; ++j) ev[(size_t)c * Km + j] = ext[(size_t)(t + 1 + j) * C + c];
            }
        };
        if (!chunked) {
            for (int t = 0; t < T; ++t) token(t);
        } else {  // a prompt's tokens: blocks of 16 on the pool (each token's sums as above)
            pool().parallel_for((T + 15) / 16, [&](int blk) {
                for (int t = blk * 16; t < std::min(T, blk * 16 + 16); ++t) token(t);
            });
        }
        for (int c = 0; c < C; ++c)
            for (int j = 0; j < Km; ++j) st[(size_t)c * Km + j] = ext[(size_t)(T + j) * C + c];
    }

    // (2) q and k heads: x * rsqrt(sum x^2 + 1e-6); q also times Dk^-0.5
    const float qscale = 1.f / std::sqrt((float)a.Dk);
    auto l2_heads = [&](int bt) {
        float* row = y.data() + (size_t)bt * C;
        for (int h = 0; h < 2 * a.Hk; ++h) {
            float* v = row + (size_t)h * a.Dk;
            float ss = 0.f;
            for (int i = 0; i < a.Dk; ++i) ss += v[i] * v[i];
            float r = 1.f / std::sqrt(ss + 1e-6f);
            if (h < a.Hk) r *= qscale;
            for (int i = 0; i < a.Dk; ++i) v[i] *= r;
        }
    };
    if (!chunked) {
        for (int bt = 0; bt < B * T; ++bt) l2_heads(bt);
    } else {
        pool().parallel_for((B * T + 15) / 16, [&](int blk) {
            for (int bt = blk * 16; bt < std::min(B * T, blk * 16 + 16); ++bt) l2_heads(bt);
        });
    }

    // (3) per (row, value head): the delta rule over the tokens, then the gated RMSNorm
    // (the kernel table's delta_head); decay and beta of every (row, token, head) first
    const int Hv = a.Hv, per_k = a.Hv / a.Hk;
    const size_t SS = (size_t)a.Dk * a.Dv;
    // the chunked form (`chunked`) takes the log decay, token by token its exp
    std::vector<float>& gates = work->gates;  // [B, Hv, T] decay (or its log), then [B, Hv, T] beta
    gates.resize((size_t)2 * B * Hv * T);
    for (int b = 0; b < B; ++b)
        for (int h = 0; h < Hv; ++h)
            for (int t = 0; t < T; ++t) {
                const size_t i = ((size_t)b * Hv + h) * T + t;
                const float av = a.a[b * a.a_sb + t * a.a_st + h], bv = a.b[b * a.b_sb + t * a.b_st + h];
                const float g = -std::exp(a.A_log[h]) * softplus(av + a.dt_bias[h]);  // log decay
                gates[i] = chunked ? g : std::exp(g);
                gates[(size_t)B * Hv * T + i] = sigmoid(bv);
            }
    // what both forms take for (row b, value head h): the tokens' q, k, v, beta, output gate,
    // norm and output; returns where the row's state sits
    auto head_args = [&](auto& d, int task) -> size_t {
        const int b = task / Hv, h = task % Hv, hk = h / per_k;
        const float* row = y.data() + (size_t)b * T * C;
        d.T = T;
        d.Dk = a.Dk;
        d.Dv = a.Dv;
        d.q = row + (size_t)hk * a.Dk;
        d.k = row + kd + (size_t)hk * a.Dk;
        d.v = row + 2 * kd + (size_t)h * a.Dv;
        d.x_st = C;
        d.beta = gates.data() + (size_t)B * Hv * T + (size_t)task * T;
        d.z = a.z + b * a.z_sb + (size_t)h * a.Dv;
        d.z_st = a.z_st;
        d.norm_w = a.norm_w;
        d.eps = a.eps;
        d.o = a.out + ((size_t)b * T * Hv + h) * a.Dv;
        d.o_st = (long)Hv * a.Dv;
        return ((a.row_slot ? (size_t)a.row_slot[b] : (size_t)b) * Hv + h) * SS;
    };
    const KernelTable& kt = kern();
    if (chunked) {  // a long pass keeping no per-token states: chunked
        pool().parallel_for(B * Hv, [&](int task) {
            std::vector<float> scratch(delta_chunk_scratch(a.Dk, a.Dv));
            DeltaChunkArgs d;
            const size_t rs = head_args(d, task);
            d.v_st = C;
            d.g = gates.data() + (size_t)task * T;
            d.S = d.S_out = a.S + rs;
            d.scratch = scratch.data();
            delta_chunk_head(d);
        });
        return;
    }
    pool().parallel_for(B * Hv, [&](int task) {
        std::vector<float> scratch(2 * (size_t)a.Dv);
        DeltaHeadArgs d;
        const size_t rs = head_args(d, task);  // the row's state
        const int b = task / Hv, h = task % Hv;
        d.decay = gates.data() + (size_t)task * T;
        d.S = a.S + rs;
        // every token's state ([B, T, Hv, Dk, Dv]), or the state itself, in place
        d.S_out = a.S_every ? a.S_every + ((size_t)b * T * Hv + h) * SS : a.S + rs;
        d.s_st = a.S_every ? (long)(Hv * SS) : 0;
        d.scratch = scratch.data();
        kt.delta_head(d);
        if (a.S_every) std::copy(d.S_out + (T - 1) * d.s_st, d.S_out + (T - 1) * d.s_st + SS, a.S + rs);
    });
}

void deltanet_block_decode(DeltaBlockArgs& a) {
    DeltaWork& w = delta_work();
    DeltaArgs& d = a.d;
    const int M = d.B * d.T, Z = d.Hv * d.Dv, N = d.C + Z + 2 * d.Hv;
    w.h.resize((size_t)M * a.H);
    w.proj.resize((size_t)M * N);
    w.o.resize((size_t)M * Z);
    half_input(a.round_bf16, M, a.H, a.x, a.norm_w, a.norm_offset, a.norm_eps, w.h.data());
    const int rows[4] = {d.C, Z, d.Hv, d.Hv};
    qlinear_multi(M, a.H, 4, a.proj, rows, w.h.data(), w.proj.data());
    round_bf16_if(a.round_bf16, w.proj.data(), w.proj.size());
    // each token's [qkv | z | a | b] side by side: every input a column slice of the projections
    float* p = w.proj.data();
    d.qkv = p;
    d.z = p + d.C;
    d.a = p + d.C + Z;
    d.b = p + d.C + Z + d.Hv;
    d.qkv_sb = d.z_sb = d.a_sb = d.b_sb = (long)d.T * N;
    d.qkv_st = d.z_st = d.a_st = d.b_st = N;
    d.out = w.o.data();
    deltanet_decode(d);  // (its own buffers are y and gates)
    round_bf16_if(a.round_bf16, w.o.data(), w.o.size());
    qlinear_multi(M, Z, 1, &a.out_proj, &a.H, w.o.data(), a.y);
    half_output(a.round_bf16, a.x, a.y, a.y, (size_t)M * a.H);
}

}  // namespace moerun
