// Gated DeltaNet (Qwen3-Next / Qwen3.5 linear attention) for a few tokens per row, token after
// token: the decode step, and a speculative verification pass that keeps every token's state.
// moerun/layers/deltanet.py is the reference (causal_conv1d, _prepare, _delta_update,
// gated_rms_norm); everything here runs in float32 in the same order of operations per token.
//
// Three phases, so each runs over independent work: (1) the causal conv + SiLU over every
// channel and token (channels are independent), (2) the L2 norm of each token's q and k heads,
// (3) the delta rule and gated RMSNorm per (row, value head), over the tokens in order — the
// only sequential part. Phase 3 reads each head's [Dk, Dv] state once and writes it once per
// token: pass 1 takes k S and q S from the old state, pass 2 writes decay * S + k^T delta
// (torch's version passes over the state three times).
#include <algorithm>
#include <cmath>
#include <vector>

#include "ops.h"
#include "thread_pool.h"

namespace moerun {
namespace {

inline float silu(float x) { return x / (1.f + std::exp(-x)); }
inline float sigmoid(float x) { return 1.f / (1.f + std::exp(-x)); }
inline float softplus(float x) { return x > 20.f ? x : std::log1p(std::exp(x)); }  // torch's threshold

struct DeltaWork {
    std::vector<float> y;  // [B, T, C] conv outputs; q and k heads L2-normalised in place (q scaled)
};

}  // namespace

void deltanet_decode(const DeltaArgs& a) {
    static DeltaWork* work = new DeltaWork();  // one op at a time (bindings hold a mutex)
    const int B = a.B, T = a.T, C = a.C, K = a.K, Km = a.K - 1;
    const int kd = a.Hk * a.Dk;
    std::vector<float>& y = work->y;
    y.resize((size_t)B * T * C);

    // (1) conv: window [state, x_t] . w, then SiLU; the state keeps the last K-1 inputs
    auto conv_rows = [&](int b, int c0, int c1) {
        std::vector<float> win(K);
        for (int c = c0; c < c1; ++c) {
            const float* w = a.conv_w + (size_t)c * K;
            float* st = a.conv + ((size_t)b * C + c) * Km;
            for (int j = 0; j < Km; ++j) win[j] = st[j];
            for (int t = 0; t < T; ++t) {
                win[Km] = a.qkv[((size_t)b * T + t) * C + c];
                float s = 0.f;
                for (int j = 0; j < K; ++j) s += win[j] * w[j];
                y[((size_t)b * T + t) * C + c] = silu(s);
                for (int j = 0; j < Km; ++j) win[j] = win[j + 1];
                if (a.conv_every)
                    std::copy(win.begin(), win.begin() + Km, a.conv_every + (((size_t)b * T + t) * C + c) * Km);
            }
            if (!a.conv_every) std::copy(win.begin(), win.begin() + Km, st);
        }
    };
    const int parts = std::max(1, std::min(pool().size(), C / 256));
    pool().parallel_for(B * parts, [&](int task) {
        int b = task / parts, p = task % parts;
        conv_rows(b, (int)((long)C * p / parts), (int)((long)C * (p + 1) / parts));
    });

    // (2) q and k heads: x * rsqrt(sum x^2 + 1e-6); q also times Dk^-0.5
    const float qscale = 1.f / std::sqrt((float)a.Dk);
    for (int bt = 0; bt < B * T; ++bt) {
        float* row = y.data() + (size_t)bt * C;
        for (int h = 0; h < 2 * a.Hk; ++h) {
            float* v = row + (size_t)h * a.Dk;
            float ss = 0.f;
            for (int i = 0; i < a.Dk; ++i) ss += v[i] * v[i];
            float r = 1.f / std::sqrt(ss + 1e-6f);
            if (h < a.Hk) r *= qscale;
            for (int i = 0; i < a.Dk; ++i) v[i] *= r;
        }
    }

    // (3) per (row, value head): the delta rule over the tokens, then the gated RMSNorm
    const int Dk = a.Dk, Dv = a.Dv, per_k = a.Hv / a.Hk;
    const size_t SS = (size_t)Dk * Dv;
    pool().parallel_for(B * a.Hv, [&](int task) {
        const int b = task / a.Hv, h = task % a.Hv, hk = h / per_k;
        std::vector<float> kS(Dv), qS(Dv), delta(Dv);
        const float* S_old = a.S + ((size_t)b * a.Hv + h) * SS;
        const float decay_base = -std::exp(a.A_log[h]);
        for (int t = 0; t < T; ++t) {
            const size_t bt = (size_t)b * T + t;
            const float* row = y.data() + bt * C;
            const float* q = row + (size_t)hk * Dk;
            const float* k = row + kd + (size_t)hk * Dk;
            const float* v = row + 2 * kd + (size_t)h * Dv;
            const float decay = std::exp(decay_base * softplus(a.a[bt * a.Hv + h] + a.dt_bias[h]));
            const float beta = sigmoid(a.b[bt * a.Hv + h]);
            float* S_new = a.S_every ? a.S_every + ((bt * a.Hv) + h) * SS : const_cast<float*>(S_old);
            // pass 1: k S and q S of the old state
            std::fill(kS.begin(), kS.end(), 0.f);
            std::fill(qS.begin(), qS.end(), 0.f);
            float qk = 0.f;
            for (int i = 0; i < Dk; ++i) {
                const float* Si = S_old + (size_t)i * Dv;
                const float ki = k[i], qi = q[i];
                for (int j = 0; j < Dv; ++j) {
                    kS[j] += ki * Si[j];
                    qS[j] += qi * Si[j];
                }
                qk += qi * ki;
            }
            float* o = a.out + (bt * a.Hv + h) * Dv;
            for (int j = 0; j < Dv; ++j) {
                delta[j] = (v[j] - kS[j] * decay) * beta;
                o[j] = qS[j] * decay + qk * delta[j];
            }
            // pass 2: S <- decay * S + k^T delta
            for (int i = 0; i < Dk; ++i) {
                const float* Si = S_old + (size_t)i * Dv;
                float* Ni = S_new + (size_t)i * Dv;
                const float ki = k[i];
                for (int j = 0; j < Dv; ++j) Ni[j] = Si[j] * decay + ki * delta[j];
            }
            S_old = S_new;
            // gated RMSNorm: o * rsqrt(mean o^2 + eps) * w * silu(z)
            float ss = 0.f;
            for (int j = 0; j < Dv; ++j) ss += o[j] * o[j];
            const float r = 1.f / std::sqrt(ss / Dv + a.eps);
            const float* z = a.z + (bt * a.Hv + h) * Dv;
            for (int j = 0; j < Dv; ++j) o[j] = a.norm_w[j] * (o[j] * r) * silu(z[j]);
        }
    });
}

}  // namespace moerun
