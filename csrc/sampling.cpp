// Choosing the next token from a row of logits, as moerun.engine.sampling does it in torch
// and numpy (its references: greedy_tokens_ref, candidate_probs): one call per row where the
// reference makes a dozen or more small tensor operations, each costing several times more
// inside a decode step than in a loop of its own (on the demo model a sampled token spent
// ~0.5 ms in them, a greedy speculative step ~0.3 ms).
#include <algorithm>
#include <cmath>
#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

#include "ops.h"

namespace moerun {

namespace {

void check_ids(const int64_t* ids, size_t n, size_t V) {
    for (size_t i = 0; i < n; ++i)
        if (ids[i] < 0 || (size_t)ids[i] >= V)
            throw std::out_of_range("token id " + std::to_string(ids[i]) + " outside the " + std::to_string(V) +
                                    " logits of a row");
}

// The ids in `ids` marked in mask (each checked against the row's width first).
void mark_ids(std::vector<uint8_t>& mask, const int64_t* ids, size_t n) {
    check_ids(ids, n, mask.size());
    for (size_t i = 0; i < n; ++i) mask[ids[i]] = 1;
}

std::vector<uint8_t>& seen_mask(size_t V) {
    thread_local std::vector<uint8_t> m;
    m.assign(V, 0);
    return m;
}

// the largest of 16 floats (NaN passes: a block holding one is looked at element by element)
inline float block_max(const float* p) {
    float m[4] = {p[0], p[1], p[2], p[3]};
    for (int i = 4; i < 16; i += 4)
        for (int j = 0; j < 4; ++j) m[j] = (p[i + j] > m[j] || p[i + j] != p[i + j]) ? p[i + j] : m[j];
    const float a = (m[0] > m[1] || m[0] != m[0]) ? m[0] : m[1], b = (m[2] > m[3] || m[2] != m[2]) ? m[2] : m[3];
    return (a > b || a != a) ? a : b;
}

inline float penalised(float v, float penalty) { return v > 0.f ? v / penalty : v * penalty; }

// numpy's argmax: the first maximum, or the first NaN where there is one
template <class F>
size_t first_max(size_t V, F value) {
    size_t best = 0;
    float bv = value(0);
    if (bv != bv) return 0;
    for (size_t i = 1; i < V; ++i) {
        const float v = value(i);
        if (v != v) return i;
        if (v > bv) {
            bv = v;
            best = i;
        }
    }
    return best;
}

}  // namespace

void greedy_picks(const float* x, size_t R, size_t V, const int64_t* seen, size_t ns, const int64_t* extra, size_t ne,
                  float penalty, bool extra_per_row, int64_t* out) {
    std::vector<uint8_t>& mark = seen_mask(V);
    mark_ids(mark, seen, ns);
    check_ids(extra, ne, V);
    if (!extra_per_row) mark_ids(mark, extra, ne);
    const bool penalise = penalty != 1.0f;
    for (size_t j = 0; j < R; ++j) {
        if (extra_per_row && j >= 1 && j - 1 < ne) mark[extra[j - 1]] = 1;  // row j: extra[:j]
        const float* row = x + j * V;
        out[j] = (int64_t)first_max(V, [&](size_t i) { return penalise && mark[i] ? penalised(row[i], penalty) : row[i]; });
    }
}

int64_t sample_row(const float* x, size_t V, const int64_t* seen, size_t ns, const int64_t* extra, size_t ne,
                   float penalty, float temperature, int top_k, float top_p, float min_p, float u, float* probs) {
    // per-thread buffers, each looked up once (a thread_local named in a loop of a shared
    // library can cost a __tls_get_addr call per use)
    thread_local std::vector<float> s_buf, heap_buf, e_buf, es_buf;
    thread_local std::vector<int> keep_buf, order_buf, drop_buf;
    std::vector<float>&s = s_buf, &heap = heap_buf, &e = e_buf, &es = es_buf;
    std::vector<int>&keep = keep_buf, &order = order_buf, &drop = drop_buf;
    // the row over the temperature in one pass (with the NaN check: torch's multinomial
    // refuses such a row too), then the penalised ids' own values: in a decode step this
    // buffer and the row come from far caches, and each pass over them cost ~15 us
    s.resize(V);
    float* sp = s.data();
    bool nan = false;
    for (size_t i = 0; i < V; ++i) {
        const float v = x[i];
        nan |= v != v;
        sp[i] = v / temperature;
    }
    if (nan) throw std::invalid_argument("logits contain NaN: nothing to sample from");
    check_ids(seen, ns, V);
    check_ids(extra, ne, V);
    if (penalty != 1.0f) {  // each id once, from the row as it came
        std::vector<uint8_t>& mark = seen_mask(V);
        for (const auto& [ids, n] : {std::pair{seen, ns}, {extra, ne}})
            for (size_t i = 0; i < n; ++i)
                if (!mark[ids[i]]) {
                    mark[ids[i]] = 1;
                    sp[ids[i]] = penalised(x[ids[i]], penalty) / temperature;
                }
    }
    const bool by_k = top_k > 0 && (size_t)top_k < V;
    // the candidates: with top-k every logit >= the k-th largest (ties with it kept too),
    // largest first (ties in id order); else every id, in id order
    keep.clear();
    if (by_k) {
        // the k-th largest: a min-heap of the k largest so far, which most logits only compare with
        // (blocks of 16 whose largest is below the heap's least are passed over whole)
        heap.assign(sp, sp + top_k);
        std::make_heap(heap.begin(), heap.end(), std::greater<float>());
        auto offer = [&](size_t i) {
            if (sp[i] > heap.front()) {
                std::pop_heap(heap.begin(), heap.end(), std::greater<float>());
                heap.back() = sp[i];
                std::push_heap(heap.begin(), heap.end(), std::greater<float>());
            }
        };
        size_t i = top_k;
        for (; i < V && i % 16; ++i) offer(i);
        for (; i + 16 <= V; i += 16)
            if (block_max(sp + i) > heap.front())
                for (size_t j = i; j < i + 16; ++j) offer(j);
        for (; i < V; ++i) offer(i);
        const float kth = heap.front();
        for (i = 0; i + 16 <= V; i += 16)
            if (block_max(sp + i) >= kth)
                for (size_t j = i; j < i + 16; ++j)
                    if (sp[j] >= kth) keep.push_back((int)j);
        for (; i < V; ++i)
            if (sp[i] >= kth) keep.push_back((int)i);
        std::stable_sort(keep.begin(), keep.end(), [&](int a, int b) { return s[a] > s[b]; });
    } else {
        keep.resize(V);
        std::iota(keep.begin(), keep.end(), 0);
    }
    const size_t C = keep.size();
    e.assign(C, 0.f);
    // softmax over the live candidates (a dropped one is -inf: exp 0)
    auto softmax = [&] {
        float m = -INFINITY;
        for (size_t c = 0; c < C; ++c) m = std::max(m, s[keep[c]]);
        float sum = 0.f;
        for (size_t c = 0; c < C; ++c) sum += (e[c] = s[keep[c]] == -INFINITY ? 0.f : std::exp(s[keep[c]] - m));
        for (size_t c = 0; c < C; ++c) e[c] /= sum;
    };
    if (top_p < 1.0f) {
        // the smallest prefix of the largest reaching top_p: drop where the sum before reaches it
        if (!by_k) {
            order = keep;
            std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return s[a] > s[b]; });
        }
        const std::vector<int>& sorted = by_k ? keep : order;
        float m = s[sorted[0]], sum = 0.f;
        es.resize(C);
        for (size_t c = 0; c < C; ++c) sum += (es[c] = std::exp(s[sorted[c]] - m));
        float cum = 0.f;
        drop.clear();
        for (size_t c = 0; c < C; ++c) {
            const float p = es[c] / sum;
            cum += p;
            if (cum - p >= top_p) drop.push_back(sorted[c]);
        }
        for (int i : drop) s[i] = -INFINITY;
    }
    if (min_p > 0.f) {
        softmax();
        const float floor = *std::max_element(e.begin(), e.end()) * min_p;
        for (size_t c = 0; c < C; ++c)
            if (e[c] < floor) s[keep[c]] = -INFINITY;
    }
    softmax();
    if (probs) {
        std::fill(probs, probs + V, 0.f);
        for (size_t c = 0; c < C; ++c) probs[keep[c]] = e[c];
    }
    if (u < 0.f) return -1;
    // inverse CDF in candidate order: the first whose cumulative probability passes u
    float total = 0.f;
    for (size_t c = 0; c < C; ++c) total += e[c];
    const float target = u * total;
    float cum = 0.f;
    size_t last = 0;
    for (size_t c = 0; c < C; ++c) {
        if (e[c] <= 0.f) continue;
        last = c;
        cum += e[c];
        if (cum > target) return keep[c];
    }
    return keep[last];
}

int64_t residual_draw(const float* p, const float* q, size_t V, double u) {
    double total = 0.0;
    for (size_t i = 0; i < V; ++i) total += std::max(0.f, p[i] - q[i]);
    const bool own = total <= 0.0;  // q covers p everywhere (rounding): p itself
    if (own) {
        total = 0.0;
        for (size_t i = 0; i < V; ++i) total += p[i];
    }
    const double target = u * total;
    double c = 0.0;
    int64_t last = -1;
    for (size_t i = 0; i < V; ++i) {
        const double w = own ? p[i] : std::max(0.f, p[i] - q[i]);
        if (w <= 0.0) continue;
        c += w;
        last = (int64_t)i;
        if (c > target) return last;
    }
    return last;  // rounding: the last id with any weight
}

}  // namespace moerun
