// Native ops over raw buffers; bindings.cpp checks shapes and dtypes and calls these.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "kernels.h"

namespace moerun {

inline float sigmoid(float x) { return 1.f / (1.f + std::exp(-x)); }
inline float silu(float x) { return x / (1.f + std::exp(-x)); }

// float32 -> bf16 bits, rounded to nearest even as torch's .to(torch.bfloat16) rounds; a NaN
// becomes torch's one quiet NaN (0x7fc0)
inline uint16_t bf16_bits(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return (u & 0x7fffffffu) > 0x7f800000u ? (uint16_t)0x7fc0 : (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
// f rounded to the nearest bf16, as a float32
inline float bf16_round(float f) {
    const uint32_t u = (uint32_t)bf16_bits(f) << 16;
    float r;
    std::memcpy(&r, &u, 4);
    return r;
}
// v[0..n) rounded to bf16 in place when `round`: where a bf16 model's separate ops would hand
// on a bf16 tensor, a fused op (the layer halves below) rounds its float32 intermediate alike
inline void round_bf16_if(bool round, float* v, size_t n) {
    if (round)
        for (size_t i = 0; i < n; ++i) v[i] = bf16_round(v[i]);
}

// Process-wide settings: which kernel table runs, how many threads the pool has and how long
// its idle workers spin before they sleep.
bool set_isa(const char* name);
const char* current_isa();
const KernelTable& kern();  // the kernel table in use
void set_threads(int n);
int get_threads();
void set_spin_us(int us);
void set_watch_shared(bool on);  // ThreadPool::set_watch
int get_spin_us();

// y[M, N] = x[M, K] @ W^T, W quantized in fmt with nb = blocks_of(K).
void qlinear(int fmt, int M, int K, int N, const float* x, const uint8_t* w, const uint16_t* ws, float* y);

// One routed expert's weights in fmt: gate and up [I rows of H], down [H rows of I], each
// with its fp16 scales (null for the float formats).
struct ExpertW {
    const uint8_t *gate, *up, *down;
    const uint16_t *gate_s, *up_s, *down_s;
};

struct QWeight;

// A shared expert run inside the routed experts' pool job (moe_block_decode, a decode-sized
// pass with quantized weights): out[T, H] = down(silu(gate x_t) * up x_t) for every token, as
// swiglu_mlp computes it without a gate vector, bit for bit.
struct SharedMlp {
    int Is;
    const QWeight *gate, *up, *down;
    float* out;
};

// Fused routed experts: out[T, H] = sum_k weights[t, k] * down_e(silu(gate_e x_t) * up_e x_t),
// e = ids[t, k] < E, expert e's weights at experts[e] (anywhere in memory). With `shared`, that
// expert's products too (into shared->out), in the same pool job where the pass is a few
// tokens (its tiles among the routed ones'), else after the routed experts.
void moe_experts(int fmt, int T, int H, int I, int E, int K, const float* x, const int64_t* ids,
                 const float* weights, const ExpertW* experts, float* out, const SharedMlp* shared = nullptr);
// The same over stacks: gate/up [E, I, row] and down [E, H, row], scales [E, rows, blocks].
void moe_experts(int fmt, int T, int H, int I, int E, int K, const float* x, const int64_t* ids,
                 const float* weights, const uint8_t* gq, const uint16_t* gs, const uint8_t* uq,
                 const uint16_t* us, const uint8_t* dq, const uint16_t* ds, float* out);

// rotate-half rope on the first rd dims of x: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)
void head_rope(float* x, const float* cos, const float* sin, int rd);

// One query token's attention over S cached positions: out[h] = softmax(scale * q_h K_j^T) V_j
// for query head h < Hq and its kv head j = h / (Hq / Hkv). q is [Hq, D] contiguous; kv head
// j's position s sits at element k + j * k_sh + s * k_ss (D contiguous values), likewise v; out is
// [Hq, Dv]. Split over (kv head, chunk of positions) and merged by log-sum-exp.
// kv_type: KvType of k and v; with int8 ones, ks/vs hold each position's scale (kv head j's
// position s at ks[j * ks_sh + s * ks_ss]).
void attn_decode(int Hq, int Hkv, int S, int D, int Dv, const float* q, const void* k, long k_sh, long k_ss,
                 const void* v, long v_sh, long v_ss, float scale, float* out, int kv_type = KV_F32,
                 const float* ks = nullptr, long ks_sh = 0, long ks_ss = 0, const float* vs = nullptr, long vs_sh = 0,
                 long vs_ss = 0);

// y[m] = x[m] / sqrt(mean(x[m]^2) + eps) * (w_g + w_offset) for M rows of D, w_g the row
// (m % G) of w [G, D] (G > 1: several norms over the column blocks of one buffer; w_offset 1:
// the zero-centred form; y may be x). Single-threaded: meant for the few rows of a decode step.
void rms_norm(int M, int D, const float* x, const float* w, float w_offset, float eps, float* y, int G = 1);
// Per-head RMSNorm (w null: none) then rotate-half rope on the first rd dims, for T tokens of
// H heads of D: x [T, H, D] -> y [H, T, D] (head-major, as attention reads it); cos, sin [T, rd].
void norm_rope_heads(int T, int H, int D, const float* x, const float* w, float w_offset, float eps,
                     const float* cos, const float* sin, int rd, float* y);

// A linear's weights: format, packed rows and fp16 scales (blocks_of(in) per row), or float32 /
// bf16 rows (FMT_F32 / FMT_BF16, s null).
struct QWeight {
    int fmt;
    const uint8_t* w;
    const uint16_t* s;
};

// P quantized linears of the same input x[M, K] at once (one activation quantization, one pool
// job): y[M, sum of rows] holds their outputs side by side, weight p's in columns
// [rows[0] + ... + rows[p - 1], + rows[p]).
void qlinear_multi(int M, int K, int P, const QWeight* w, const int* rows, const float* x, float* y);

// The routing of a softmax top-k MoE block for T tokens (decode-sized): logits = x R^T with
// R [E, H] float32, softmax over the E logits, the K most probable experts (largest first,
// ties to the lower expert), their probabilities renormalised to sum 1 when renorm. ids [T, K],
// w [T, K]. Each token's logits are summed in the same order whatever T is.
void route_softmax_topk(int T, int H, int E, int K, bool renorm, const float* x, const float* R, int64_t* ids,
                        float* w);

// The routing of a grouped sigmoid MoE block (DeepSeek-V3): scores s = sigmoid(x R^T); the
// experts are picked by s + bias (bias [E] float32, selection only): with n_group > 1 the E
// experts form n_group groups of E / n_group, each group scores the sum of its two largest
// biased scores and only the topk_group best groups keep their experts; then the K best
// experts (largest biased score first, ties to the lower expert, ties between groups to the
// lower group). w = their unbiased s, divided by (their sum + 1e-20) when renorm, times scale.
struct SigmoidRoute {
    const float* bias;  // [E]
    int n_group, topk_group;
    float scale;
};
void route_sigmoid_grouped(int T, int H, int E, int K, bool renorm, const SigmoidRoute& r, const float* x,
                           const float* R, int64_t* ids, float* w);

// A SwiGLU MLP of quantized linears (a dense layer, a shared expert): y[M, H] =
// down(silu(gate x) * up x), gate/up [I, blocks_of(H)], down [H, blocks_of(I)]; x [M, H].
// gate and up run as one qlinear_multi job, SiLU * up in float32, then down: one call for what
// takes two native calls and two torch ops otherwise.
// With gate_vec [H] (a shared expert's gate), row m of y is scaled by sigmoid(x_m . gate_vec).
void swiglu_mlp(int M, int H, int I, const QWeight& gate, const QWeight& up, const QWeight& down, const float* x,
                float* y, const float* gate_vec = nullptr);

// T tokens (one row: decode, or a speculative verification pass) through a GQA attention block
// with a float32 or bf16 KV cache, in one call:
// q, k, v = x W^T; optional per-head RMSNorm of q and k (weights qn, kn [D], nullptr for none);
// rope on each head's first rd dims (rotate-half pairing, cos/sin [T, rd]); token t's k, v
// written at position pos + t of the cache (kv head j's position s at kc + j * c_sh + s * D;
// float32 or bf16 by kv_type, rounded to nearest even); its attention over positions
// 0..pos + t; out[T, H] = o_proj of the results; x is [T, H]. Everything between the
// projections runs in float32. gated (Qwen3.5): q_proj yields 2D rows per head, its query then
// its output gate g, and the attention output is multiplied by sigmoid(g) before o_proj.
// With `half` the block is a decoder layer's first half: out = x + block(RMSNorm(x)) (weight
// norm_w + offset, eps), the normed x, the block's output and out each rounded to bf16 with
// round_bf16 (a bf16 model), where the separate ops hand them on in bf16. Tokens before
// first_out only write their keys and values: their rows of out are left as they were.
// Variants (defaults: none of them): qkv_bias [rows of q_proj + 2 * Hkv * D] is added to the
// projections' outputs (Qwen2-MoE; q_proj's rows then k's then v's, in float32 after the
// product); norm_across: qn [Hq * D] and kn [Hkv * D] are one RMSNorm over all heads' q and
// all heads' k (OLMoE) instead of per-head weights [D]; window > 0: token t at position p
// attends only to positions p - window + 1 .. p (sliding-window attention: Mixtral, Qwen2).
struct AttnHalf {
    const float* norm_w;
    float offset, eps;
    bool round_bf16;
};
void attn_block_decode(int H, int Hq, int Hkv, int D, const float* x, const QWeight& q, const QWeight& k,
                       const QWeight& v, const QWeight& o, const float* qn, const float* kn, float eps,
                       const float* cos, const float* sin, int rd, void* kc, void* vc, long c_sh, int pos,
                       float scale, float* out, int kv_type = KV_F32, bool gated = false, int T = 1,
                       const AttnHalf* half = nullptr, int first_out = 0, const long* row_off = nullptr,
                       const int* row_pos = nullptr, const float* qkv_bias = nullptr, bool norm_across = false,
                       int window = 0);

// attn_block_decode's arguments but x and out, for an op that runs it inside (mtp_step_decode)
struct AttnBlockArgs {
    int H, Hq, Hkv, D;
    QWeight q, k, v, o;
    const float *qn, *kn;
    float eps;
    const float *cos, *sin;
    int rd;
    void *kc, *vc;
    long c_sh;
    int pos;
    float scale;
    int kv_type;
    bool gated;
    int T;
    AttnHalf half;
    bool has_half;
    int first_out = 0;  // the first token whose output is wanted (those before only write the cache)
    // a batch's decode step: token t is a row of its own, its cache at kc / vc + row_off[t]
    // values, at position row_pos[t] (null: the tokens are one row's, at pos, pos + 1, ...)
    const long* row_off = nullptr;
    const int* row_pos = nullptr;
    // the variants (attn_block_decode): q/k/v bias, q/k norms across heads, a sliding window
    const float* qkv_bias = nullptr;
    bool norm_across = false;
    int window = 0;
};
inline void attn_block_decode(const AttnBlockArgs& a, const float* x, float* out) {
    attn_block_decode(a.H, a.Hq, a.Hkv, a.D, x, a.q, a.k, a.v, a.o, a.qn, a.kn, a.eps, a.cos, a.sin, a.rd, a.kc, a.vc,
                      a.c_sh, a.pos, a.scale, out, a.kv_type, a.gated, a.T, a.has_half ? &a.half : nullptr, a.first_out,
                      a.row_off, a.row_pos, a.qkv_bias, a.norm_across, a.window);
}

// DeepSeek-V3's attention half (multi-head latent attention, MLA) for a few tokens, each its own
// row of a cache of joined [R + Dr] rows (csrc/mla.cpp; the reference is
// models/deepseek_v3.py, Attention._absorbed). Per token: q = q_b(RMSNorm(q_a x)) (Q > 0) or
// q_proj x (Q == 0), [N, Dn + Dr]; kv = kv_a x -> latent = RMSNorm(kv[:R]), k_rot = kv[R:];
// rope (rotate-half, after de-interleaving pairs (2i, 2i+1) when `interleaved`, as the module)
// on each head's q_rot and on k_rot; [latent | k_rot] written at the token's position; W_kb
// absorbed into the query: q_lat[n] = W_kb[n]^T q_nope[n] ([R]); attention of [q_lat | q_rot]
// over the positions' [latent | k_rot] (one kv head of R + Dr, N query heads, values the
// latent); out[n] = W_vb[n] out_lat[n] ([Dv]); o_proj. Float32 inside; with half.round_bf16
// (a bf16 model) each tensor the module hands on in bf16 is rounded to bf16 (the projections,
// the norms, the roped parts, q_lat, out_lat, out). With `has_half`: out = x + block(RMSNorm(x))
// as attn_block_decode's `half`. Token i sits at position row_pos[i] of the cache row at
// c + row_off[i] elements (position s's R + Dr values at + s * (R + Dr)); tokens are taken in
// order, each written before its attention (a row's tokens see the ones before them). Tokens
// before first_out only write the cache.
struct MlaArgs {
    int H, N, Q, R, Dr, Dn, Dv;
    QWeight qa;   // Q > 0: q_a_proj [Q rows of H]; Q == 0: q_proj [N * (Dn + Dr) rows of H]
    QWeight qb;   // Q > 0: q_b_proj [N * (Dn + Dr) rows of Q]
    QWeight kva;  // kv_a_proj_with_mqa [R + Dr rows of H]
    QWeight o;    // o_proj [H rows of N * Dv]
    const float *qa_bias = nullptr, *kva_bias = nullptr, *o_bias = nullptr;  // or null
    const float* q_norm = nullptr;  // [Q]
    float q_eps = 1e-6f;
    const float* kv_norm;  // [R]
    float kv_eps;
    int wfmt;             // FMT_F32 or FMT_BF16: wkb and kvb
    const uint8_t* wkb;   // [N, R, Dn]: head n's W_kb transposed
    const uint8_t* kvb;   // kv_b_proj [N * (Dn + Dv), R]: head n's W_vb its rows n * (Dn + Dv) + Dn ..
    const float *cos, *sin;  // [T, Dr]
    bool interleaved;
    void* c;
    int kv_type;  // KV_F32 or KV_BF16
    float scale;
    int T;
    AttnHalf half;
    bool has_half;
    int first_out = 0;
    const long* row_off;
    const int* row_pos;
};
void mla_block_decode(const MlaArgs& a, const float* x, float* out);

// The MoE half of a decoder layer for T tokens (decode-sized), in one call: y = x + moe(h)
// with h = RMSNorm(x) (weight norm_w + norm_offset, eps); moe(h) routes h by softmax top-k
// (route_softmax_topk: router [E, H] float32, renorm) or, with `sigmoid`, by grouped sigmoid
// scores (route_sigmoid_grouped), runs the routed experts (moe_experts:
// experts[e] in efmt, width I) and, with shared (gate, up, down of width Is), adds the shared
// expert scaled by sigmoid(h . shared_gate) (swiglu_mlp; shared_gate may be null). Each
// intermediate is what the separate ops produce; with round_bf16 (a bf16 model) each is
// also rounded to bf16 where the separate calls hand a bf16 tensor on (h, the routing weights,
// the experts' sum, the shared expert's output, their sum, y), so y is bit-identical to them.
// h_out, ids_out, w_out (each may be null) receive h, the ids [T, K] and the weights [T, K].
// seen (null, or E + 1 bytes: a route mask) gets a 1 at each routed expert and K at [E].
// Routed experts that are found pass by pass (an expert store's, wherever each lies): a MoE
// half asks for the experts its routing picked, reads them in place, and hands them back.
struct ExpertSource {
    virtual ~ExpertSource() = default;
    // the table [E] with at least the entries of ids [T * K] filled; valid until done()
    virtual const ExpertW* fetch(int T, int K, const int64_t* ids) = 0;
    // the pass is over (ok: its experts ran; otherwise it failed and must not throw again)
    virtual void done(bool ok) = 0;
};

// Watches a MoE half's routing (a predictor or a profiler: `layers.routes`): called once the
// router has picked, before the experts run, with h [T, H] (the half's normed input; a bf16
// model's values rounded to bf16), ids and weights [T, K]. It may throw: the pass then fails.
struct RouteObserver {
    virtual ~RouteObserver() = default;
    virtual void routed(int T, int H, int K, const float* h, const int64_t* ids, const float* w) = 0;
};

struct MoeBlockArgs {
    int T, H, E, K, I, Is;
    bool renorm, round_bf16;
    const float* x;                     // [T, H]
    const float* norm_w;                // [H]
    float norm_offset, eps;
    const float* router;                // [E, H]
    const SigmoidRoute* sigmoid = nullptr;  // or null: softmax top-k
    int efmt;
    const ExpertW* experts;             // [E], or null with a source
    ExpertSource* source;               // or null: the experts are all in `experts`
    const QWeight *sg, *su, *sd;        // the shared expert, or null
    const float* shared_gate;           // [H] or null
    float* y;                           // [T, H]
    float* h_out;
    int64_t* ids_out;
    float* w_out;
    uint8_t* seen;
    RouteObserver* observer = nullptr;  // or null: nobody watches
};
void moe_block_decode(const MoeBlockArgs& a);

// The dense MLP half of a decoder layer for T tokens (decode-sized), in one call: y = x +
// down(silu(gate h) * up h), h = RMSNorm(x) (weight norm_w + norm_offset, eps), the MLP as
// swiglu_mlp computes it; with round_bf16 h, the MLP's output and y rounded to bf16 where the
// separate ops (rms_norm, swiglu_mlp, an add) hand on a bf16 tensor: y is bit-identical to them.
struct MlpBlockArgs {
    int T, H, I;
    bool round_bf16;
    const float* x;       // [T, H]
    const float* norm_w;  // [H]
    float norm_offset, eps;
    QWeight gate, up, down;
    float* y;             // [T, H]
};
void mlp_block_decode(const MlpBlockArgs& a);

// Gated DeltaNet (Qwen3.5 linear attention) over T tokens per row, token after token (decode,
// or a speculative verification pass): causal conv + SiLU over the in_proj_qkv outputs, L2
// norm of the q and k heads (q scaled by Dk^-0.5), the gated delta rule with
// decay = exp(-exp(A_log) * softplus(a + dt_bias)) and beta = sigmoid(b), then
// RMSNorm(o) * norm_w * silu(z) per value head. Value head h reads key head h / (Hv / Hk).
// All float32. conv and S are updated in place to the state after the last token; with the
// *_every outputs the state after each token is written there too. The projections' outputs
// (qkv, a, b, z) may be column slices of one wider buffer: each has its own row (b) and token
// (t) strides, in floats, and is contiguous within a token; everything else is contiguous.
struct DeltaArgs {
    int B, T, C, K, Hk, Hv, Dk, Dv;
    const float* qkv;              // [B, T, C]: in_proj_qkv outputs before the conv (q | k | v)
    long qkv_sb, qkv_st;
    const float* conv_w;           // [K, C]: the conv's weights transposed
    float* conv;                   // [B, C, K - 1]: the last K - 1 inputs of each channel
    float* conv_every;             // [B, T, C, K - 1] or nullptr
    const float *a, *b;            // [B, T, Hv]: in_proj_a and in_proj_b outputs
    long a_sb, a_st, b_sb, b_st;
    const float *A_log, *dt_bias;  // [Hv]
    float* S;                      // [B, Hv, Dk, Dv]
    float* S_every;                // [B, T, Hv, Dk, Dv] or nullptr
    const float* z;                // [B, T, Hv, Dv]: the output gate
    long z_sb, z_st;
    const float* norm_w;           // [Dv]
    float eps;
    float* out;                    // [B, T, Hv, Dv]
    // rows at slots of a larger state: row b's conv and S are those at index row_slot[b] of
    // `conv` and `S` (null: row b at index b)
    const int64_t* row_slot = nullptr;
};
void deltanet_decode(const DeltaArgs& a);

// The chunked gated delta rule (csrc/delta_chunk.cpp, csrc/delta_chunk.inc): one (row, value
// head) over T tokens in chunks of kDeltaChunk, the same results as the token-by-token
// recurrence (DeltaHeadArgs) up to float32 rounding: o_t = q_t S_t and the final state. q and k
// are already L2-normalised (q scaled by Dk^-0.5); g is the log decay (<= 0). With norm_w,
// each output then gets the gated RMSNorm (o * rsqrt(mean o^2 + eps) * norm_w * silu(z)).
constexpr int kDeltaChunk = 64;
// deltanet_decode runs a pass of at least this many tokens per row (that keeps no per-token
// states) in the chunked form where its tokens times a row's state elements (Hv x Dk x Dv)
// exceed kDeltaChunkMinWork; fewer, or a small model's short prompt (the demo's 4 x 32 x 32
// state up to 256 tokens: what the token-by-token step served before), token by token
constexpr int kDeltaChunkMinTokens = 16;
constexpr long kDeltaChunkMinWork = 1L << 20;
inline bool delta_chunked(int T, int Hv, int Dk, int Dv, bool every) {
    return !every && T >= kDeltaChunkMinTokens && (long)T * Hv * Dk * Dv > kDeltaChunkMinWork;
}
struct DeltaChunkArgs {
    int T, Dk, Dv;
    const float *q, *k, *v;  // token t's q and k at + t * x_st, its v at v + t * v_st
    long x_st, v_st;
    const float *g, *beta;   // [T]: log decay, beta
    const float* S;          // [Dk, Dv]: the state before the first token
    float* S_out;            // the state after the last (may be S)
    float* o;                // token t's output at o + t * o_st
    long o_st;
    const float* z = nullptr;       // with norm_w: token t's output gate at z + t * z_st
    long z_st = 0;
    const float* norm_w = nullptr;  // [Dv] or null (no norm)
    float eps = 0.f;
    float* scratch;          // delta_chunk_scratch(Dk, Dv) floats
};
size_t delta_chunk_scratch(int Dk, int Dv);
void delta_chunk_head(const DeltaChunkArgs& a);  // the copy for the kernel table in use (kern())
// y[0..n) = silu(y) in place, vectorized (delta_chunk.inc's vsilu: within ~2e-7 relative of
// x * sigmoid(x)), the copy for the kernel table in use; each value's result depends on it alone
void silu_rows(float* y, long n);
// The whole op over q, k [B, T, Hk, Dk], v and out [B, T, Hv, Dv], g and beta [B, T, Hv] (all
// float32, contiguous; q and k as they come out of the conv: L2-normalised here, q scaled) and
// S [B, Hv, Dk, Dv] (updated in place to the state after the last token). Value head h reads
// key head h / (Hv / Hk). Threaded over (row, value head).
void delta_rule_chunked(int B, int T, int Hk, int Hv, int Dk, int Dv, const float* q, const float* k, const float* v,
                        const float* g, const float* beta, float* S, float* out);

// The linear-attention half of a Qwen3.5 decoder layer for a few tokens per row, in one call:
// y = x + out_proj(deltanet(proj(RMSNorm(x)))), x and y [B, T, H]. proj: in_proj_qkv, in_proj_z,
// in_proj_a, in_proj_b of RMSNorm(x) (weight norm_w + norm_offset, eps norm_eps) as one
// qlinear_multi job; their outputs feed `d` (whose qkv, a, b, z and out this call fills: leave
// them null); out_proj reads its output. With round_bf16 (a bf16 model) each intermediate the
// separate ops hand on in bf16 is rounded to bf16 here (the normed x, the projections, the
// DeltaNet's output, out_proj's, y): bit-identical to them.
struct DeltaBlockArgs {
    DeltaArgs d;
    int H;
    const float* x;
    const float* norm_w;
    float norm_offset, norm_eps;
    QWeight proj[4];  // in_proj_qkv [C], in_proj_z [Hv * Dv], in_proj_a [Hv], in_proj_b [Hv] rows of H
    QWeight out_proj;  // [H] rows of Hv * Dv
    bool round_bf16;
    float* y;
};
void deltanet_block_decode(DeltaBlockArgs& a);

// One draft step of a one-layer MTP head (Qwen3.5's) over T tokens of one row, in one call:
// for each token its embedding and the trunk's hidden state (u [T, 2, H]) RMS-normed with
// their own weights (pre_w [2, H], weights already offset), side by side through fc (H rows
// of 2H); the decoder layer's attention half over the T tokens (`attn`, its x and out this
// call's), its MoE half on the last token only (`moe`: T = 1, x and y left null); the final
// RMSNorm into h [H] and the head (V rows of H) into logits [V]. With round_bf16 (a bf16
// model) every intermediate the separate ops hand on in bf16 is rounded here: bit-identical
// to them.
struct MtpStepArgs {
    int T, H, V;
    bool round_bf16;
    const float* u;
    const float* pre_w;
    float pre_eps;
    QWeight fc;
    AttnBlockArgs attn;
    MoeBlockArgs moe;
    const float* norm_w;
    float norm_offset, norm_eps;
    QWeight head;
    float* h;
    float* logits;
};
void mtp_step_decode(MtpStepArgs& a);

// Next-token choice for rows of float32 logits (sampling.cpp; references in
// moerun.engine.sampling). greedy_picks: out[j] = the first maximum of row j of x [R, V] with
// the repetition penalty on the ids of seen and of extra[:j] (`extra_per_row`, a verification
// pass's positions) or all of extra; numpy's argmax (a NaN's index where the row has one).
void greedy_picks(const float* x, size_t R, size_t V, const int64_t* seen, size_t ns, const int64_t* extra, size_t ne,
                  float penalty, bool extra_per_row, int64_t* out);
// sample_row: one row [V] through the penalty (seen and extra), temperature, top-k (ties with
// the k-th kept), top-p and min-p; probs (when not null) gets the distribution over the row;
// returns the token whose cumulative probability first passes u in [0, 1) (in candidate
// order: largest first with top-k, else id order), or -1 for u < 0.
int64_t sample_row(const float* x, size_t V, const int64_t* seen, size_t ns, const int64_t* extra, size_t ne,
                   float penalty, float temperature, int top_k, float top_p, float min_p, float u, float* probs);
// residual_draw: a rejected draft's replacement (speculative sampling) from norm(max(0, p - q))
// over V ids (p, q distributions; p itself where that is all zero): the first id whose
// cumulative sum, in id order and double precision, passes u * the total, u in [0, 1).
int64_t residual_draw(const float* p, const float* q, size_t V, double u);

// The ends of a layer half (moe_block_decode, deltanet_block_decode, attn_block_decode with
// `half`), as the separate ops compute them: the input RMSNorm, and the residual add of the
// half's output f (each rounded to bf16 with `round`, as the bf16 ops hand them on).
inline void half_input(bool round, int T, int H, const float* x, const float* w, float offset, float eps, float* h) {
    rms_norm(T, H, x, w, offset, eps, h);
    round_bf16_if(round, h, (size_t)T * H);
}
inline void half_output(bool round, const float* x, float* f, float* y, size_t n) {  // y = x + f (y may be f)
    round_bf16_if(round, f, n);
    for (size_t i = 0; i < n; ++i) y[i] = x[i] + f[i];
    round_bf16_if(round, y, n);
}

}  // namespace moerun
