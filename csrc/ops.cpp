// Drivers: split each op into tiles of (weight rows x tokens) and run them on the pool.
#include "ops.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "thread_pool.h"

namespace moerun {

ThreadPool& pool() {
    // never destroyed: joining threads during interpreter shutdown can hang
    static ThreadPool* p = new ThreadPool(1);
    return *p;
}

namespace {
const KernelTable* g_kernels = nullptr;
}  // namespace

const KernelTable& kern() {
    if (!g_kernels) g_kernels = best_kernels();
    return *g_kernels;
}

namespace {

constexpr int kTokTile = 64;  // activation rows per tile: 64 x 2 KiB stays in L2
constexpr int kChainedPairs = 64;  // moe_experts: up to this many (token, expert) pairs in one pool job

struct Tile {
    int e, r0, nr, t0, nt;
};

// Rows per tile: enough tiles to balance the pool; where a tile has more tokens than the
// 256-bit kernels take in one pass over its rows (4; the 512-bit ones take 8, and their
// tiles of 5-8 tokens are cut too), few enough rows that they stay in L1/L2 while the
// tokens stream past them. With at most 4 tokens each row is read once, so a tile is a few
// long streams (the kernels' for_rows_in_streams): what their start costs (the first rows, before the prefetches ahead of the
// rows pay off) is paid once per tile, not once per 64 rows.
// A tile is also at least kTileMacs multiply-adds a token (rows x inputs), where the rows
// allow: a task costs ~0.1 us to hand out and set up, as much as 16 rows of 128 inputs take
// (the demo model's experts: 64 x 128, cut into 4 tiles each).
constexpr int kTileMacs = 16384;
int row_tile(int rows, int inputs, int n_groups, int threads, int max_tok) {
    int want = std::max(1, 8 * threads / std::max(1, n_groups));
    int rt = (rows + want - 1) / want;
    rt = std::max(rt, kTileMacs / std::max(1, inputs));
    rt = (rt + 3) / 4 * 4;
    return std::max(4, max_tok <= 4 ? rt : std::min(rt, 64));
}

void gemm(int fmt, const GemmArgs& a) {
    if (is_raw_fmt(fmt))
        kern().gemm_raw(fmt, a);
    else if (fmt == FMT_INT4)
        kern().gemm_q4(a);
    else if (fmt == FMT_INT8)
        kern().gemm_q8(a);
    else if (fmt == FMT_BF16)
        kern().gemm_bf16(a);
    else
        kern().gemm_f32(a);
}

struct ActQ {
    std::vector<int8_t> q;
    std::vector<float> d, s;
    void resize(size_t rows, int nb) {
        q.resize(rows * nb * QK);
        d.resize(rows * nb);
        s.resize(rows * nb);
    }
};

void quantize_rows(const float* x, size_t ld, int rows, int n, int nb, ActQ& aq) {
    aq.resize(rows, nb);
    auto& k = kern();
    auto one = [&](int r) { k.quantize_row(x + r * ld, n, nb, aq.q.data() + (size_t)r * nb * QK, aq.d.data() + (size_t)r * nb, aq.s.data() + (size_t)r * nb); };
    if (rows < 16) {
        for (int r = 0; r < rows; ++r) one(r);
    } else {
        const int parts = pool().width();
        int per = (rows + parts - 1) / parts;
        pool().parallel_for(parts, [&](int t) {
            for (int r = t * per; r < std::min(rows, (t + 1) * per); ++r) one(r);
        });
    }
}

// Workspace kept between calls (one op at a time: bindings hold a mutex).
struct Workspace {
    ActQ x, h;
    std::vector<float> g, u, y, qkv, att, gate;
    std::vector<float> sg, su;  // moe_experts: a shared expert's gate and up outputs (SharedMlp)
    ActQ sh;                    // and its activations for down
    std::vector<int32_t> pair_tok, slot;
    std::vector<int> count, offset, count_left, ready;
    // the layer halves': the normed input, the routing weights and ids, the experts' sum and
    // the shared expert's output
    std::vector<float> normed, route_w, moe_out, shared_out;
    std::vector<int64_t> route_ids;
    std::vector<float> route_c, route_g;  // grouped routing's biased scores and group scores
    std::vector<char> route_taken;
    std::vector<float> mtp[4];  // an MTP step's normed inputs, fc's output, the attention half's, the MoE half's
};
Workspace& ws() {  // one op at a time (bindings hold a mutex)
    static Workspace* w = new Workspace();
    return *w;
}

}  // namespace

bool set_isa(const char* name) {
    const KernelTable* k = kernels_for(name);
    if (!k) return false;
    g_kernels = k;
    return true;
}
const char* current_isa() { return kern().name; }
void set_threads(int n) { pool().resize(n); }
int get_threads() { return pool().size(); }
void set_spin_us(int us) { pool().set_spin_us(us); }
void set_watch_shared(bool on) { pool().set_watch(on); }
int get_spin_us() { return pool().spin_us(); }

void qlinear_multi(int M, int K, int P, const QWeight* w, const int* rows, const float* x, float* y) {
    const int nb = blocks_of(K);
    ActQ& xq = ws().x;
    bool quantized = false;  // float weights read x as it is; packed ones its int8 blocks
    for (int p = 0; p < P; ++p) quantized |= !is_float_fmt(w[p].fmt);
    if (quantized) quantize_rows(x, K, M, K, nb, xq);
    std::vector<int> off(P + 1, 0);
    for (int p = 0; p < P; ++p) off[p + 1] = off[p] + rows[p];
    const int N = off[P];
    const int n_tt = (M + kTokTile - 1) / kTokTile;
    const int rt = row_tile(N, K, n_tt, pool().width(), M);
    std::vector<Tile> tiles;  // e: which weight
    for (int p = 0; p < P; ++p)
        for (int r0 = 0; r0 < rows[p]; r0 += rt)
            for (int t0 = 0; t0 < M; t0 += kTokTile)
                tiles.push_back({p, r0, std::min(rt, rows[p] - r0), t0, std::min(kTokTile, M - t0)});
    pool().parallel_for((int)tiles.size(), [&](int i) {
        const Tile& t = tiles[i];
        const QWeight& q = w[t.e];
        const size_t rb = weight_row_bytes(q.fmt, K);
        GemmArgs a;
        a.nrows = t.nr;
        a.nb = nb;
        a.w = q.w + (size_t)t.r0 * rb;
        a.w_row = rb;
        a.ntok = t.nt;
        a.xidx = nullptr;
        if (is_float_fmt(q.fmt)) {
            a.in = K;
            a.xf = x + (size_t)t.t0 * K;
            a.x_row = K;
        } else {
            a.ws = is_raw_fmt(q.fmt) ? nullptr : q.s + (size_t)t.r0 * nb;  // raw formats: scales in the rows
            a.xq = xq.q.data() + (size_t)t.t0 * nb * QK;
            a.xd = xq.d.data() + (size_t)t.t0 * nb;
            a.xs = xq.s.data() + (size_t)t.t0 * nb;
        }
        a.y = y + (size_t)t.t0 * N + off[t.e] + t.r0;
        a.y_row = N;
        gemm(q.fmt, a);
    });
}

namespace {
// h[j] = silu(g[j]) * u[j] for j < n (silu_rows' silu: the MLPs' and the experts' activation)
void silu_mul(const float* g, const float* u, float* h, int n) {
    std::copy(g, g + n, h);
    silu_rows(h, n);
    for (int j = 0; j < n; ++j) h[j] *= u[j];
}

// x . r in a fixed order (8 partial sums, then the tail), so that a token's result does not
// depend on how many tokens share the call
float dot8(const float* x, const float* r, int n) {
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    int i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; ++j) acc[j] += x[i + j] * r[i + j];
    float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (; i < n; ++i) s += x[i] * r[i];
    return s;
}
}  // namespace

namespace {
// logits = x R^T [T, E] (in the workspace's `att`)
float* router_logits(int T, int H, int E, const float* x, const float* R) {
    Workspace& W = ws();
    W.att.resize((size_t)T * E);
    float* lg = W.att.data();
    // the logits are a float32 GEMM (the ISA's float kernel: each (token, expert) dot product
    // in one fixed order whatever T is); a small router runs on this thread
    if ((size_t)E * H < 65536 && T <= 4) {
        GemmArgs a;
        a.nrows = E;
        a.nb = blocks_of(H);
        a.w = reinterpret_cast<const uint8_t*>(R);
        a.w_row = (size_t)H * sizeof(float);
        a.ws = nullptr;
        a.ntok = T;
        a.xidx = nullptr;
        a.y = lg;
        a.y_row = E;
        a.in = H;
        a.xf = x;
        a.x_row = H;
        kern().gemm_f32(a);
    } else {
        const QWeight r{FMT_F32, reinterpret_cast<const uint8_t*>(R), nullptr};
        qlinear_multi(T, H, 1, &r, &E, x, lg);
    }
    return lg;
}

// The routers' top-k: K passes over n scores v (K is small, n at most a few hundred), pass k
// picking the largest v[i] among the indices still free (`free(i)`: not taken yet, nor masked
// out), the lower index on ties, and handing it to `take(k, i)`, which marks it taken in the
// caller's way. A pass that finds none (NaN scores compare false) takes 0: the ids stay in range.
template <class Free, class Take>
void select_top_k(const float* v, int n, int K, Free free, Take take) {
    for (int k = 0; k < K; ++k) {
        int best = -1;
        for (int i = 0; i < n; ++i)
            if (free(i) && (best < 0 || v[i] > v[best])) best = i;
        take(k, best < 0 ? 0 : best);
    }
}
}  // namespace

void route_softmax_topk(int T, int H, int E, int K, bool renorm, const float* x, const float* R, int64_t* ids,
                        float* w) {
    float* lg = router_logits(T, H, E, x, R);
    for (int t = 0; t < T; ++t) {
        float* l = lg + (size_t)t * E;
        float m = l[0];
        for (int e = 1; e < E; ++e) m = std::max(m, l[e]);
        float sum = 0.f;
        for (int e = 0; e < E; ++e) sum += (l[e] = std::exp(l[e] - m));
        int64_t* id = ids + (size_t)t * K;
        float* wt = w + (size_t)t * K;
        float picked = 0.f;
        // probabilities are >= 0: a taken one is marked -1 (a NaN one is never free)
        select_top_k(l, E, K, [&](int e) { return l[e] >= 0.f; }, [&](int k, int e) {
            id[k] = e;
            wt[k] = l[e] / sum;
            picked += wt[k];
            l[e] = -1.f;
        });
        if (renorm)
            for (int k = 0; k < K; ++k) wt[k] /= picked;
    }
}

void route_sigmoid_grouped(int T, int H, int E, int K, bool renorm, const SigmoidRoute& r, const float* x,
                           const float* R, int64_t* ids, float* w) {
    Workspace& W = ws();
    float* lg = router_logits(T, H, E, x, R);
    const int G = r.n_group > 1 ? r.n_group : 1, per = E / G;
    W.route_c.resize(E);
    W.route_g.resize(G);
    W.route_taken.resize(std::max(E, G));
    float* c = W.route_c.data();
    float* gsc = W.route_g.data();
    char* taken = W.route_taken.data();
    constexpr float NEG = -std::numeric_limits<float>::infinity();
    for (int t = 0; t < T; ++t) {
        float* s = lg + (size_t)t * E;
        for (int e = 0; e < E; ++e) {
            s[e] = sigmoid(s[e]);
            c[e] = s[e] + r.bias[e];
        }
        if (G > 1) {
            for (int g = 0; g < G; ++g) {  // each group's two largest biased scores, summed
                const float* cg = c + (size_t)g * per;
                float a = NEG, b = NEG;
                for (int j = 0; j < per; ++j) {
                    if (cg[j] > a) {
                        b = a;
                        a = cg[j];
                    } else if (cg[j] > b) {
                        b = cg[j];
                    }
                }
                gsc[g] = a + b;
            }
            std::fill(taken, taken + G, 0);
            select_top_k(gsc, G, r.topk_group, [&](int g) { return !taken[g]; }, [&](int, int g) { taken[g] = 1; });
            for (int g = 0; g < G; ++g)
                if (!taken[g]) std::fill(c + (size_t)g * per, c + (size_t)(g + 1) * per, NEG);
        }
        std::fill(taken, taken + E, 0);
        int64_t* id = ids + (size_t)t * K;
        float* wt = w + (size_t)t * K;
        float picked = 0.f;
        // by biased score, among the groups kept (the others' experts are at -inf)
        select_top_k(c, E, K, [&](int e) { return !taken[e] && c[e] > NEG; }, [&](int k, int e) {
            taken[e] = 1;
            id[k] = e;
            wt[k] = s[e];
            picked += wt[k];
        });
        for (int k = 0; k < K; ++k) wt[k] = (renorm ? wt[k] / (picked + 1e-20f) : wt[k]) * r.scale;
    }
}

void swiglu_mlp(int M, int H, int I, const QWeight& gate, const QWeight& up, const QWeight& down, const float* x,
                float* y, const float* gate_vec) {
    Workspace& W = ws();
    W.g.resize((size_t)M * 2 * I);  // [M, gate | up]
    W.u.resize((size_t)M * I);
    const QWeight gu[2] = {gate, up};
    const int rows[2] = {I, I};
    qlinear_multi(M, H, 2, gu, rows, x, W.g.data());
    auto act = [&](int m) {
        const float* g = W.g.data() + (size_t)m * 2 * I;
        float* h = W.u.data() + (size_t)m * I;
        silu_mul(g, g + I, h, I);
    };
    if (M < 16) {
        for (int m = 0; m < M; ++m) act(m);
    } else {
        pool().parallel_for(M, act);
    }
    qlinear_multi(M, I, 1, &down, &H, W.u.data(), y);
    if (gate_vec)
        for (int m = 0; m < M; ++m) {
            const float gm = sigmoid(dot8(x + (size_t)m * H, gate_vec, H));
            for (int j = 0; j < H; ++j) y[(size_t)m * H + j] *= gm;
        }
}

void moe_block_decode(const MoeBlockArgs& a) {
    Workspace& W = ws();
    const size_t n = (size_t)a.T * a.H, nk = (size_t)a.T * a.K;
    float* h = a.h_out ? a.h_out : (W.normed.resize(n), W.normed.data());
    int64_t* ids = a.ids_out ? a.ids_out : (W.route_ids.resize(nk), W.route_ids.data());
    float* w = a.w_out ? a.w_out : (W.route_w.resize(nk), W.route_w.data());
    W.moe_out.resize(n);
    float* e = W.moe_out.data();
    half_input(a.round_bf16, a.T, a.H, a.x, a.norm_w, a.norm_offset, a.eps, h);
    if (a.sigmoid)
        route_sigmoid_grouped(a.T, a.H, a.E, a.K, a.renorm, *a.sigmoid, h, a.router, ids, w);
    else
        route_softmax_topk(a.T, a.H, a.E, a.K, a.renorm, h, a.router, ids, w);
    if (a.seen) {
        for (size_t i = 0; i < nk; ++i) a.seen[ids[i]] = 1;
        a.seen[a.E] = (uint8_t)a.K;
    }
    round_bf16_if(a.round_bf16, w, nk);
    if (a.observer) a.observer->routed(a.T, a.H, a.K, h, ids, w);
    // the shared expert's products run in the routed experts' job (SharedMlp: swiglu_mlp's
    // bits), its gate applied here as swiglu_mlp applies it
    W.shared_out.resize(a.sg ? n : 0);
    float* s = W.shared_out.data();
    const SharedMlp shared{a.Is, a.sg, a.su, a.sd, s};
    const SharedMlp* sh = a.sg ? &shared : nullptr;
    if (a.source) {
        // the source's experts are handed back however the pass ends
        struct Back {
            ExpertSource* s;
            bool ok = false;
            ~Back() { if (!ok) s->done(false); }
        } back{a.source};
        moe_experts(a.efmt, a.T, a.H, a.I, a.E, a.K, h, ids, w, a.source->fetch(a.T, a.K, ids), e, sh);
        back.ok = true;
        a.source->done(true);
    } else {
        moe_experts(a.efmt, a.T, a.H, a.I, a.E, a.K, h, ids, w, a.experts, e, sh);
    }
    round_bf16_if(a.round_bf16, e, n);
    if (a.sg) {  // the block adds the shared expert's output to the experts' (both in bf16 for a bf16 model)
        if (a.shared_gate)
            for (int m = 0; m < a.T; ++m) {
                const float gm = sigmoid(dot8(h + (size_t)m * a.H, a.shared_gate, a.H));
                for (int j = 0; j < a.H; ++j) s[(size_t)m * a.H + j] *= gm;
            }
        half_output(a.round_bf16, e, s, e, n);
    }
    half_output(a.round_bf16, a.x, e, a.y, n);
}

void mlp_block_decode(const MlpBlockArgs& a) {
    Workspace& W = ws();
    const size_t n = (size_t)a.T * a.H;
    W.normed.resize(n);
    W.moe_out.resize(n);
    half_input(a.round_bf16, a.T, a.H, a.x, a.norm_w, a.norm_offset, a.eps, W.normed.data());
    swiglu_mlp(a.T, a.H, a.I, a.gate, a.up, a.down, W.normed.data(), W.moe_out.data(), nullptr);
    half_output(a.round_bf16, a.x, W.moe_out.data(), a.y, n);
}

void qlinear(int fmt, int M, int K, int N, const float* x, const uint8_t* w, const uint16_t* ws_, float* y) {
    const QWeight q{fmt, w, ws_};
    qlinear_multi(M, K, 1, &q, &N, x, y);
}

void moe_experts(int fmt, int T, int H, int I, int E, int K, const float* x, const int64_t* ids,
                 const float* weights, const uint8_t* gq, const uint16_t* gs, const uint8_t* uq,
                 const uint16_t* us, const uint8_t* dq, const uint16_t* ds, float* out) {
    const int gf = gate_fmt(fmt), df = down_fmt(fmt);
    const bool fl = is_float_fmt(gf), dfl = is_float_fmt(df);
    const size_t grow = weight_row_bytes(gf, H) * I, drow = weight_row_bytes(df, I) * H;
    // raw formats keep no scales (their stacks' scales are empty)
    const size_t gsn = is_raw_fmt(gf) ? 0 : (size_t)I * blocks_of(H), dsn = is_raw_fmt(df) ? 0 : (size_t)H * blocks_of(I);
    std::vector<ExpertW> ex(E);
    for (int e = 0; e < E; ++e)
        ex[e] = {gq + e * grow, uq + e * grow, dq + e * drow, fl ? nullptr : gs + e * gsn,
                 fl ? nullptr : us + e * gsn, dfl ? nullptr : ds + e * dsn};
    moe_experts(fmt, T, H, I, E, K, x, ids, weights, ex.data(), out);
}

void moe_experts(int fmt, int T, int H, int I, int E, int K, const float* x, const int64_t* ids,
                 const float* weights, const ExpertW* experts, float* out, const SharedMlp* shared) {
    Workspace& W = ws();
    // fmt: gate/up's format and down's (expert_fmt); float weights: float activations, no scales
    const int gf = gate_fmt(fmt), df = down_fmt(fmt);
    const bool fl = is_float_fmt(gf), dfl = is_float_fmt(df);
    const int nbH = blocks_of(H), nbI = blocks_of(I);
    const size_t growb = weight_row_bytes(gf, H), drowb = weight_row_bytes(df, I);
    const int P = T * K;

    // group the (token, expert) pairs by expert: pairs of expert e are [offset[e], offset[e+1])
    W.count.assign(E, 0);
    for (int p = 0; p < P; ++p) {
        int64_t e = ids[p];
        if (e < 0 || e >= E) throw std::out_of_range("expert id " + std::to_string(e) + " outside [0, " + std::to_string(E) + ")");
        W.count[e]++;
    }
    W.offset.assign(E + 1, 0);
    for (int e = 0; e < E; ++e) W.offset[e + 1] = W.offset[e] + W.count[e];
    W.pair_tok.resize(P);
    W.slot.resize(P);
    {
        std::vector<int> fill(W.offset.begin(), W.offset.end() - 1);
        for (int p = 0; p < P; ++p) {
            int s = fill[ids[p]]++;
            W.pair_tok[s] = p / K;
            W.slot[p] = s;
        }
    }

    if (!fl) quantize_rows(x, H, T, H, nbH, W.x);

    // tiles over (expert, weight rows, tokens of that expert)
    auto make_tiles = [&](int rows, int inputs, std::vector<Tile>& tiles) {
        int active = 0, most = 0;
        for (int e = 0; e < E; ++e) {
            active += W.count[e] > 0;
            most = std::max(most, W.count[e]);
        }
        int rt = row_tile(rows, inputs, active, pool().width(), most);
        tiles.clear();
        for (int e = 0; e < E; ++e)
            for (int t0 = 0; t0 < W.count[e]; t0 += kTokTile)
                for (int r0 = 0; r0 < rows; r0 += rt)
                    tiles.push_back({e, r0, std::min(rt, rows - r0), t0, std::min(kTokTile, W.count[e] - t0)});
    };
    std::vector<Tile> gu_tiles, down_tiles;
    make_tiles(I, H, gu_tiles);
    make_tiles(H, I, down_tiles);
    W.g.resize((size_t)P * I);
    W.u.resize((size_t)P * I);
    W.y.resize((size_t)P * H);
    if (!dfl) W.h.resize(P, nbI);

    // gate and up of a tile: G, U [P, I]
    auto gate_up = [&](const Tile& t) {
        const ExpertW& ew = experts[t.e];
        GemmArgs a;
        a.nrows = t.nr;
        a.nb = nbH;
        a.w_row = growb;
        a.ntok = t.nt;
        if (!fl) {
            a.xq = W.x.q.data();
            a.xd = W.x.d.data();
            a.xs = W.x.s.data();
        }
        a.xidx = W.pair_tok.data() + W.offset[t.e] + t.t0;
        a.in = H;
        a.xf = x;
        a.x_row = H;
        a.y_row = I;
        a.w = ew.gate + t.r0 * growb;
        a.ws = fl || !ew.gate_s ? nullptr : ew.gate_s + (size_t)t.r0 * nbH;
        a.y = W.g.data() + (size_t)(W.offset[t.e] + t.t0) * I + t.r0;
        gemm(gf, a);
        a.w = ew.up + t.r0 * growb;
        a.ws = fl || !ew.up_s ? nullptr : ew.up_s + (size_t)t.r0 * nbH;
        a.y = W.u.data() + (size_t)(W.offset[t.e] + t.t0) * I + t.r0;
        gemm(gf, a);
    };
    // h = silu(g) * u of pairs [p0, p1), quantized once per pair for the down projection (float
    // weights: kept in float, in place of u)
    auto activate = [&](int p0, int p1) {
        thread_local std::vector<float> hrow;
        hrow.resize(I);
        if (dfl) {
            for (int p = p0; p < p1; ++p) {
                float* u = W.u.data() + (size_t)p * I;
                silu_mul(W.g.data() + (size_t)p * I, u, hrow.data(), I);
                std::copy(hrow.begin(), hrow.end(), u);
            }
            return;
        }
        auto& k = kern();
        for (int p = p0; p < p1; ++p) {
            const float* g = W.g.data() + (size_t)p * I;
            const float* u = W.u.data() + (size_t)p * I;
            silu_mul(g, u, hrow.data(), I);
            k.quantize_row(hrow.data(), I, nbI, W.h.q.data() + (size_t)p * nbI * QK, W.h.d.data() + (size_t)p * nbI,
                           W.h.s.data() + (size_t)p * nbI);
        }
    };
    // down of a tile: Y [P, H]
    auto down = [&](const Tile& t) {
        const ExpertW& ew = experts[t.e];
        size_t p0 = W.offset[t.e] + t.t0;
        GemmArgs a;
        a.nrows = t.nr;
        a.nb = nbI;
        a.w = ew.down + t.r0 * drowb;
        a.w_row = drowb;
        a.ntok = t.nt;
        a.xidx = nullptr;
        if (dfl) {
            a.in = I;
            a.xf = W.u.data() + p0 * I;
            a.x_row = I;
        } else {
            a.ws = ew.down_s ? ew.down_s + (size_t)t.r0 * nbI : nullptr;
            a.xq = W.h.q.data() + p0 * nbI * QK;
            a.xd = W.h.d.data() + p0 * nbI;
            a.xs = W.h.s.data() + p0 * nbI;
        }
        a.y = W.y.data() + p0 * H + t.r0;
        a.y_row = H;
        gemm(df, a);
    };

    // the shared expert's tiles (every token; its own formats and width), when it runs in the
    // chained job below: the same products as swiglu_mlp's (one activation quantization of x,
    // each row's sums independent of the tiling), into W.sg / W.su, then shared->out
    const bool fold = shared && P <= kChainedPairs && !fl && !is_float_fmt(shared->gate->fmt) &&
                      !is_float_fmt(shared->up->fmt) && !is_float_fmt(shared->down->fmt);
    std::vector<Tile> sgu_tiles, sd_tiles;
    const int Is = shared ? shared->Is : 0, nbIs = blocks_of(Is);
    if (fold) {
        const int rt_gu = row_tile(Is, H, 1, pool().width(), T), rt_d = row_tile(H, Is, 1, pool().width(), T);
        for (int r0 = 0; r0 < Is; r0 += rt_gu) sgu_tiles.push_back({E, r0, std::min(rt_gu, Is - r0), 0, T});
        for (int r0 = 0; r0 < H; r0 += rt_d) sd_tiles.push_back({E, r0, std::min(rt_d, H - r0), 0, T});
        W.sg.resize((size_t)T * Is);
        W.su.resize((size_t)T * Is);
        W.sh.resize(T, nbIs);
    }
    auto shared_gemm = [&](const QWeight& q, int K_in, const Tile& t, const ActQ& xq, float* y, int y_row) {
        const size_t rb = weight_row_bytes(q.fmt, K_in);
        const int nb = blocks_of(K_in);
        GemmArgs a;
        a.nrows = t.nr;
        a.nb = nb;
        a.w = q.w + (size_t)t.r0 * rb;
        a.w_row = rb;
        a.ws = is_raw_fmt(q.fmt) ? nullptr : q.s + (size_t)t.r0 * nb;
        a.ntok = t.nt;
        a.xidx = nullptr;
        a.xq = xq.q.data();
        a.xd = xq.d.data();
        a.xs = xq.s.data();
        a.y = y + t.r0;
        a.y_row = y_row;
        gemm(q.fmt, a);
    };
    auto shared_activate = [&]() {
        thread_local std::vector<float> hrow;
        hrow.resize(Is);
        auto& k = kern();
        for (int p = 0; p < T; ++p) {
            const float* g = W.sg.data() + (size_t)p * Is;
            const float* u = W.su.data() + (size_t)p * Is;
            silu_mul(g, u, hrow.data(), Is);
            k.quantize_row(hrow.data(), Is, nbIs, W.sh.q.data() + (size_t)p * nbIs * QK, W.sh.d.data() + (size_t)p * nbIs,
                           W.sh.s.data() + (size_t)p * nbIs);
        }
    };

    const int n_gu = (int)gu_tiles.size(), n_down = (int)down_tiles.size();
    const int n_sgu = (int)sgu_tiles.size(), n_sd = (int)sd_tiles.size();
    if (P <= kChainedPairs) {
        // A few tokens (decode, a verification pass): one pool job, each expert's down tiles
        // after its own gate/up tiles, where three jobs (gate/up, activation, down) each ended
        // on every thread waiting for the slowest and the next started its weights' streams
        // cold. Tiles are handed out in order, gate/up ones first, so a thread that takes a down
        // tile waits only on gate/up tiles already taken; the last of an expert's gate/up tiles
        // activates its pairs. The same tiles and arithmetic as the phases: the same bits.
        // The shared expert (`fold`) is expert E here: its gate/up tiles after the routed ones,
        // its down tiles last.
        W.count_left.assign(E + 1, 0);  // per expert: its gate/up tiles not done yet
        for (const Tile& t : gu_tiles) W.count_left[t.e]++;
        W.count_left[E] = n_sgu;
        W.ready.assign(E + 1, 0);
        pool().parallel_for(n_gu + n_sgu + n_down + n_sd, [&](int i) {
            if (i < n_gu) {
                const Tile& t = gu_tiles[i];
                gate_up(t);
                if (__atomic_sub_fetch(&W.count_left[t.e], 1, __ATOMIC_ACQ_REL) == 0) {
                    activate(W.offset[t.e], W.offset[t.e + 1]);
                    __atomic_store_n(&W.ready[t.e], 1, __ATOMIC_RELEASE);
                }
                return;
            }
            i -= n_gu;
            if (i < n_sgu) {
                const Tile& t = sgu_tiles[i];
                shared_gemm(*shared->gate, H, t, W.x, W.sg.data(), Is);
                shared_gemm(*shared->up, H, t, W.x, W.su.data(), Is);
                if (__atomic_sub_fetch(&W.count_left[E], 1, __ATOMIC_ACQ_REL) == 0) {
                    shared_activate();
                    __atomic_store_n(&W.ready[E], 1, __ATOMIC_RELEASE);
                }
                return;
            }
            i -= n_sgu;
            const Tile& t = i < n_down ? down_tiles[i] : sd_tiles[i - n_down];
            while (!__atomic_load_n(&W.ready[t.e], __ATOMIC_ACQUIRE)) __builtin_ia32_pause();
            if (i < n_down)
                down(t);
            else
                shared_gemm(*shared->down, Is, t, W.sh, shared->out, H);
        });
    } else {
        pool().parallel_for(n_gu, [&](int i) { gate_up(gu_tiles[i]); });
        if (dfl) {
            activate(0, P);
        } else {
            const int nt = std::min(P, pool().width()), per = (P + nt - 1) / nt;
            pool().parallel_for(nt, [&](int ti) { activate(ti * per, std::min(P, (ti + 1) * per)); });
        }
        pool().parallel_for(n_down, [&](int i) { down(down_tiles[i]); });
    }

    // weighted sum over each token's experts, in k order (deterministic)
    auto combine = [&](int t, int j0, int j1) {
        float* o = out + (size_t)t * H;
        for (int j = j0; j < j1; ++j) o[j] = 0.f;
        for (int k = 0; k < K; ++k) {
            float wk = weights[(size_t)t * K + k];
            const float* yk = W.y.data() + (size_t)W.slot[(size_t)t * K + k] * H;
            for (int j = j0; j < j1; ++j) o[j] += wk * yk[j];
        }
    };
    if ((size_t)T * H * K <= (size_t)kTileMacs) {  // a few tokens of a small model: less than handing it out
        for (int t = 0; t < T; ++t) combine(t, 0, H);
    } else {
        pool().parallel_for(T, [&](int t) { combine(t, 0, H); });
    }
    if (shared && !fold)  // (its own jobs; W.g and W.u are free again)
        swiglu_mlp(T, H, Is, *shared->gate, *shared->up, *shared->down, x, shared->out, nullptr);
}

void attn_decode(int Hq, int Hkv, int S, int D, int Dv, const float* q, const void* k, long k_sh, long k_ss,
                 const void* v, long v_sh, long v_ss, float scale, float* out, int kv_type, const float* ks,
                 long ks_sh, long ks_ss, const float* vs, long vs_sh, long vs_ss) {
    const size_t esz = kv_type == KV_I8 ? 1 : kv_type == KV_BF16 ? 2 : 4;  // bytes per key/value element
    const int G = Hq / Hkv;
    // chunks of positions: enough tasks for the pool, each long enough to amortise its merge
    // and short enough that its values stay in L2 while every query head of the group reads
    // them (float32, 4096 positions, one thread: 256-position chunks 3.4 vs 7.4 ms as one).
    // The chunks set the merge's order, so the bits: they are cut for 16 tasks whatever the
    // threads, so that every thread count gives the same bits (and the pool's width, which
    // drops to 1 while the CPU is shared, cannot change them between two steps)
    const int want = std::max(1, (16 + Hkv - 1) / Hkv);
    const int chunk = std::min(256, std::max(64, (S + want - 1) / want));
    const int nc = (S + chunk - 1) / chunk;
    Workspace& W = ws();
    const size_t per_task = (size_t)G * (chunk + 2 + Dv);  // p, m, l, o
    W.g.resize((size_t)Hkv * nc * per_task);
    auto& kn = kern();
    pool().parallel_for(Hkv * nc, [&](int task) {
        const int j = task / nc, c = task % nc, s0 = c * chunk;
        float* base = W.g.data() + (size_t)task * per_task;
        AttnArgs a;
        a.kv_type = kv_type;
        a.G = G;
        a.D = D;
        a.Dv = Dv;
        a.n = std::min(chunk, S - s0);
        a.q = q + (size_t)j * G * D;
        a.k = (const char*)k + (j * k_sh + s0 * k_ss) * esz;
        a.k_ss = k_ss;
        a.v = (const char*)v + (j * v_sh + s0 * v_ss) * esz;
        a.v_ss = v_ss;
        a.k_scale = ks ? ks + j * ks_sh + s0 * ks_ss : nullptr;
        a.ks_ss = ks_ss;
        a.v_scale = vs ? vs + j * vs_sh + s0 * vs_ss : nullptr;
        a.vs_ss = vs_ss;
        a.scale = scale;
        a.p = base;
        a.m = base + (size_t)G * chunk;
        a.l = a.m + G;
        a.o = a.l + G;
        kn.attn_chunk(a);
    });
    for (int j = 0; j < Hkv; ++j) {
        for (int g = 0; g < G; ++g) {
            float M = -INFINITY;
            for (int c = 0; c < nc; ++c) M = std::max(M, W.g[(size_t)(j * nc + c) * per_task + (size_t)G * chunk + g]);
            float L = 0.f;
            float* o = out + (size_t)(j * G + g) * Dv;
            for (int d = 0; d < Dv; ++d) o[d] = 0.f;
            for (int c = 0; c < nc; ++c) {
                const float* base = W.g.data() + (size_t)(j * nc + c) * per_task;
                const float* mc = base + (size_t)G * chunk;
                float f = std::exp(mc[g] - M);
                L += f * mc[G + g];
                const float* oc = mc + 2 * G + (size_t)g * Dv;
                for (int d = 0; d < Dv; ++d) o[d] += f * oc[d];
            }
            for (int d = 0; d < Dv; ++d) o[d] /= L;
        }
    }
}

namespace {

// float32 -> bf16, rounded to nearest even (as torch's .to(torch.bfloat16) for finite values)
void to_bf16(const float* x, int n, uint16_t* y) {
    for (int i = 0; i < n; ++i) {
        uint32_t u;
        std::memcpy(&u, x + i, 4);
        if ((u & 0x7fffffffu) > 0x7f800000u) {  // NaN stays NaN
            y[i] = (uint16_t)((u >> 16) | 0x40);
            continue;
        }
        u += 0x7fffu + ((u >> 16) & 1u);
        y[i] = (uint16_t)(u >> 16);
    }
}

}  // namespace

// rotate-half rope (ops.h) on the first rd dims: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)
void head_rope(float* x, const float* cos, const float* sin, int rd) {
    const int h = rd / 2;
    for (int i = 0; i < h; ++i) {
        const float x1 = x[i], x2 = x[i + h];
        x[i] = x1 * cos[i] - x2 * sin[i];
        x[i + h] = x2 * cos[i + h] + x1 * sin[i + h];
    }
}

void rms_norm(int M, int D, const float* x, const float* w, float w_offset, float eps, float* y, int G) {
    for (int m = 0; m < M; ++m) {
        const float* xm = x + (size_t)m * D;
        const float* wm = w + (size_t)(m % G) * D;
        float* ym = y + (size_t)m * D;
        float ss = 0.f;
        for (int d = 0; d < D; ++d) ss += xm[d] * xm[d];
        const float r = 1.f / std::sqrt(ss / D + eps);
        for (int d = 0; d < D; ++d) ym[d] = (xm[d] * r) * (wm[d] + w_offset);
    }
}

void norm_rope_heads(int T, int H, int D, const float* x, const float* w, float w_offset, float eps,
                     const float* cos, const float* sin, int rd, float* y) {
    auto rows = [&](int r0, int r1) {  // row r: head r / T, token r % T
        for (int r = r0; r < r1; ++r) {
            const int h = r / T, t = r % T;
            const float* xr = x + ((size_t)t * H + h) * D;
            float* yr = y + (size_t)r * D;
            if (w)
                rms_norm(1, D, xr, w, w_offset, eps, yr);
            else
                std::copy(xr, xr + D, yr);
            head_rope(yr, cos + (size_t)t * rd, sin + (size_t)t * rd, rd);
        }
    };
    const int n = T * H;
    if (n < 64) {
        rows(0, n);
        return;
    }
    const int parts = std::min(n, 4 * pool().width()), per = (n + parts - 1) / parts;
    pool().parallel_for(parts, [&](int i) { rows(i * per, std::min(n, (i + 1) * per)); });
}

void attn_block_decode(int H, int Hq, int Hkv, int D, const float* x, const QWeight& q, const QWeight& k,
                       const QWeight& v, const QWeight& o, const float* qn, const float* kn, float eps,
                       const float* cos, const float* sin, int rd, void* kc, void* vc, long c_sh, int pos,
                       float scale, float* out, int kv_type, bool gated, int T, const AttnHalf* half, int first_out,
                       const long* row_off, const int* row_pos, const float* qkv_bias, bool norm_across, int window) {
    Workspace& W = ws();
    const float* x_in = x;
    if (half) {
        W.normed.resize((size_t)T * H);
        half_input(half->round_bf16, T, H, x, half->norm_w, half->offset, half->eps, W.normed.data());
        x = W.normed.data();
    }
    // q, k and v in one job (the small k and v projections share the pool): row t of W.qkv is
    // token t's q (and gate) | k | v
    const int nq = Hq * D, nk = Hkv * D, nqr = gated ? 2 * nq : nq, ld = nqr + 2 * nk;
    W.qkv.resize((size_t)T * ld);
    const QWeight parts[3] = {q, k, v};
    const int rows[3] = {nqr, nk, nk};
    qlinear_multi(T, H, 3, parts, rows, x, W.qkv.data());
    if (qkv_bias) {  // (Qwen2-MoE) the projections' biases, as a biased linear adds them after its product
        for (int t = 0; t < T; ++t) {
            float* r = W.qkv.data() + (size_t)t * ld;
            for (int i = 0; i < ld; ++i) r[i] += qkv_bias[i];
        }
    }
    W.att.resize((size_t)T * nq);
    if (gated) W.gate.resize((size_t)T * nq);
    const size_t esize = kv_type == KV_BF16 ? 2 : 4;
    for (int t = 0; t < T; ++t) {  // token t at position p (pos + t, or its row's) sees positions 0..p
        const int p = row_pos ? row_pos[t] : pos + t;
        void* kt = row_off ? (char*)kc + row_off[t] * esize : kc;
        void* vt = row_off ? (char*)vc + row_off[t] * esize : vc;
        float* qt = W.qkv.data() + (size_t)t * ld;
        const float *ct = cos + (size_t)t * rd, *st = sin + (size_t)t * rd;
        const bool wanted = t >= first_out;
        if (gated && wanted) {  // head h's rows are its query then its output gate: set the gates aside, close up the queries
            float* gt = W.gate.data() + (size_t)t * nq;
            for (int h = 0; h < Hq; ++h) {
                std::copy(qt + (size_t)(2 * h + 1) * D, qt + (size_t)(2 * h + 2) * D, gt + (size_t)h * D);
                std::copy(qt + (size_t)(2 * h) * D, qt + (size_t)(2 * h + 1) * D, qt + (size_t)h * D);
            }
        }
        if (norm_across) {  // (OLMoE) one norm over all heads' q, one over all heads' k
            if (qn && wanted) rms_norm(1, nq, qt, qn, 0.f, eps, qt);
            if (kn) rms_norm(1, nk, qt + nqr, kn, 0.f, eps, qt + nqr);
        }
        for (int h = 0; wanted && h < Hq; ++h) {
            if (qn && !norm_across) rms_norm(1, D, qt + (size_t)h * D, qn, 0.f, eps, qt + (size_t)h * D);
            head_rope(qt + (size_t)h * D, ct, st, rd);
        }
        for (int j = 0; j < Hkv; ++j) {
            float* kj = qt + nqr + (size_t)j * D;
            const float* vj = qt + nqr + nk + (size_t)j * D;
            if (kn && !norm_across) rms_norm(1, D, kj, kn, 0.f, eps, kj);
            head_rope(kj, ct, st, rd);
            const long at = j * c_sh + (long)p * D;
            if (kv_type == KV_BF16) {
                to_bf16(kj, D, (uint16_t*)kt + at);
                to_bf16(vj, D, (uint16_t*)vt + at);
            } else {
                std::copy(kj, kj + D, (float*)kt + at);
                std::copy(vj, vj + D, (float*)vt + at);
            }
        }
        if (!wanted) continue;
        float* at = W.att.data() + (size_t)t * nq;
        // a sliding window: only positions s0..p (the cache keeps the older ones)
        const int s0 = window > 0 ? std::max(0, p + 1 - window) : 0;
        const size_t skip = (size_t)s0 * D * esize;
        attn_decode(Hq, Hkv, p + 1 - s0, D, D, qt, (const char*)kt + skip, c_sh, D, (const char*)vt + skip, c_sh, D,
                    scale, at, kv_type);
        if (gated) {
            const float* gt = W.gate.data() + (size_t)t * nq;
            for (int i = 0; i < nq; ++i) at[i] *= sigmoid(gt[i]);
        }
    }
    const size_t f = (size_t)first_out;
    qlinear(o.fmt, T - first_out, Hq * D, H, W.att.data() + f * nq, o.w, o.s, out + f * H);
    if (half) half_output(half->round_bf16, x_in + f * H, out + f * H, out + f * H, (T - f) * H);
}

void mtp_step_decode(MtpStepArgs& a) {
    Workspace& W = ws();
    const int T = a.T, H = a.H;
    const size_t n = (size_t)T * H;
    W.mtp[0].resize(2 * n);
    W.mtp[1].resize(n);
    W.mtp[2].resize(n);
    W.mtp[3].resize(H);
    float *normed = W.mtp[0].data(), *f = W.mtp[1].data(), *x = W.mtp[2].data(), *y = W.mtp[3].data();
    rms_norm(2 * T, H, a.u, a.pre_w, 0.f, a.pre_eps, normed, 2);
    round_bf16_if(a.round_bf16, normed, 2 * n);
    qlinear_multi(T, 2 * H, 1, &a.fc, &H, normed, f);
    round_bf16_if(a.round_bf16, f, n);
    a.attn.first_out = T - 1;  // only the last token goes on: the others' keys and values are cached
    attn_block_decode(a.attn, f, x);
    a.moe.x = x + (size_t)(T - 1) * H;
    a.moe.y = y;
    moe_block_decode(a.moe);
    rms_norm(1, H, y, a.norm_w, a.norm_offset, a.norm_eps, a.h);
    round_bf16_if(a.round_bf16, a.h, H);
    qlinear_multi(1, H, 1, &a.head, &a.V, a.h, a.logits);
    round_bf16_if(a.round_bf16, a.logits, a.V);
}

}  // namespace moerun
