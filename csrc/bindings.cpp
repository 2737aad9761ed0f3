// The one binding file of moerun's native extension: it only exposes the native ops to Python
// with typed signatures. Kernels live in their own files; the arrays' checks in arrays.inc,
// the op lock in op_lock.inc, and what runs a layer half, the MTP head or the layer stack
// with arguments checked once (NativeMtp, NativeStack, expert sources, route observers) in
// executors.inc.
//
// Tensors arrive through DLPack (nanobind ndarray), so the extension never links libtorch.
// Outputs are allocated by the caller (torch) and filled here. Every op runs with the GIL
// released and under one mutex: the pool and the workspace serve one op at a time.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <tuple>

#include "kernels.h"
#include "ops.h"
#include "thread_pool.h"

namespace nb = nanobind;
using Array = nb::ndarray<nb::device::cpu, nb::c_contig>;
// any strides (attention's cache views, the projections' column slices): checked where taken
using Strided = nb::ndarray<nb::device::cpu>;

static std::map<std::string, bool> cpu_features() {
    __builtin_cpu_init();
    return {
        {"avx2", (bool)__builtin_cpu_supports("avx2")},
        {"fma", (bool)__builtin_cpu_supports("fma")},
        {"avx512f", (bool)__builtin_cpu_supports("avx512f")},
        {"avx512bw", (bool)__builtin_cpu_supports("avx512bw")},
        {"avx512vl", (bool)__builtin_cpu_supports("avx512vl")},
        {"avx512vnni", (bool)__builtin_cpu_supports("avx512vnni")},
        {"avxvnni", (bool)__builtin_cpu_supports("avxvnni")},
        {"avx512bf16", (bool)__builtin_cpu_supports("avx512bf16")},
    };
}

#include "op_lock.inc"  // native ops run one at a time

namespace {

#include "arrays.inc"  // arrays from Python checked and converted; packed weights as the kernels take them

// How an op's call ends, once its arguments are checked. run_locked: op() with the GIL released,
// under the op lock. run_out: so, with out (float32, or bf16 rounded from a float32 buffer after
// the op: ActOut) handed to op as float*. run_act: so, with the activation x (float32, or bf16
// widened: ActIn) handed on too.
template <class Op>
void run_locked(Op&& op) {
    nb::gil_scoped_release release;
    OpLock lk;
    op();
}

template <class Op>
void run_out(Array& out, Op&& op) {
    ActOut o(out, "out");
    run_locked([&] {
        op(o.p);
        o.finish();
    });
}

template <class Op>
void run_act(const Array& x, Array& out, Op&& op) {
    ActIn xin(x, "x");
    run_out(out, [&](float* y) { op(xin.p, y); });
}

void qlinear(Array x, Array w, Array scales, Array out, int fmt) {
    check_fmt(fmt);
    check_dtype(x, dtype_code::Float, 32, "x");
    MOERUN_CHECK(x.ndim() == 2, "x must be [M, K]");
    const size_t M = x.shape(0), K = x.shape(1);
    MOERUN_CHECK(w.ndim() == 2, "w must be [N, bytes per row]");
    const size_t N = w.shape(0);
    const int nb = moerun::blocks_of((int)K);
    check_width(fmt, K, "w");
    check_qweight(w, fmt, {N}, nb, "w");
    check_scales(scales, fmt, {N}, nb, "scales");
    check_dtype(out, dtype_code::Float, 32, "out");
    check_shape(out, {M, N}, "out");
    run_locked([&] {
        moerun::qlinear(fmt, (int)M, (int)K, (int)N, (const float*)x.data(), (const uint8_t*)w.data(),
                        (const uint16_t*)scales.data(), (float*)out.data());
    });
}

// x [T, H] (float32 or bf16: ActIn) with each token's expert ids [T, K] int64 and weights [T, K] float32 -> (T, H, K)
std::tuple<size_t, size_t, size_t> routed_tokens(const Array& x, const Array& ids, const Array& weights) {
    MOERUN_CHECK(x.ndim() == 2, "x must be [T, H]");
    const size_t T = x.shape(0), H = x.shape(1);
    check_dtype(ids, dtype_code::Int, 64, "ids");
    MOERUN_CHECK(ids.ndim() == 2 && ids.shape(0) == T, "ids must be [T, K]");
    const size_t K = ids.shape(1);
    check_dtype(weights, dtype_code::Float, 32, "weights");
    check_shape(weights, {T, K}, "weights");
    return {T, H, K};
}

// Routed experts' weights as the ops take them: gate, up and down each a list of one stack
// ([E, I, row] and [E, H, row]) or of one array per expert ([I, row] and [H, row], wherever
// each lies), in fmt: float32 or bf16 (as uint16) rows of H / I values with no scales (the
// scale lists empty), or int4 / int8 rows with their scales lists alike. -> (table, I).
std::pair<std::vector<moerun::ExpertW>, size_t> expert_table(int fmt, size_t H, const std::vector<Array>& gate,
                                                             const std::vector<Array>& gs, const std::vector<Array>& up,
                                                             const std::vector<Array>& us, const std::vector<Array>& down,
                                                             const std::vector<Array>& ds) {
    MOERUN_CHECK(!gate.empty() && gate.size() == up.size() && gate.size() == down.size(),
                 "gate, up, down: as many arrays each");
    check_efmt(fmt);
    const int gf = moerun::gate_fmt(fmt), df = moerun::down_fmt(fmt);
    const bool fl = moerun::is_float_fmt(gf);
    MOERUN_CHECK(fl ? gs.empty() && us.empty() && ds.empty() : gs.size() == gate.size() && us.size() == gate.size() &&
                                                                 ds.size() == gate.size(),
                 "scales: one per weight array for int4 / int8 experts, none for float ones");
    const bool stacked = gate[0].ndim() == 3;
    MOERUN_CHECK((stacked && gate.size() == 1) || gate[0].ndim() == 2,
                 "gate: one stack [E, I, row] or one [I, row] array per expert");
    const size_t E = stacked ? gate[0].shape(0) : gate.size();
    const size_t I = gate[0].shape(stacked ? 1 : 0);
    const int nbH = moerun::blocks_of((int)H), nbI = moerun::blocks_of((int)I);
    if (!fl) {
        check_width(gf, H, "gate");
        check_width(df, I, "down");
    }
    const std::vector<size_t> lead_gu = stacked ? std::vector<size_t>{E, I} : std::vector<size_t>{I};
    const std::vector<size_t> lead_d = stacked ? std::vector<size_t>{E, H} : std::vector<size_t>{H};
    for (size_t j = 0; j < gate.size(); ++j) {
        if (fl) {
            check_float_weight(gate[j], fmt, with_last(lead_gu, H), "gate");
            check_float_weight(up[j], fmt, with_last(lead_gu, H), "up");
            check_float_weight(down[j], fmt, with_last(lead_d, I), "down");
            continue;
        }
        check_qweight(gate[j], gf, lead_gu, nbH, "gate");
        check_qweight(up[j], gf, lead_gu, nbH, "up");
        check_qweight(down[j], df, lead_d, nbI, "down");
        check_scales(gs[j], gf, lead_gu, nbH, "gate scales");
        check_scales(us[j], gf, lead_gu, nbH, "up scales");
        check_scales(ds[j], df, lead_d, nbI, "down scales");
    }
    const size_t grow = moerun::weight_row_bytes(gf, (int)H) * I, drow = moerun::weight_row_bytes(df, (int)I) * H;
    const size_t gsn = moerun::is_raw_fmt(gf) ? 0 : I * nbH, dsn = moerun::is_raw_fmt(df) ? 0 : H * nbI;
    std::vector<moerun::ExpertW> ex(E);
    for (size_t e = 0; e < E; ++e) {
        const size_t j = stacked ? 0 : e, k = stacked ? e : 0;
        ex[e] = {(const uint8_t*)gate[j].data() + k * grow, (const uint8_t*)up[j].data() + k * grow,
                 (const uint8_t*)down[j].data() + k * drow,
                 fl ? nullptr : (const uint16_t*)gs[j].data() + k * gsn,
                 fl ? nullptr : (const uint16_t*)us[j].data() + k * gsn,
                 fl ? nullptr : (const uint16_t*)ds[j].data() + k * dsn};
    }
    return {std::move(ex), I};
}

// Fused routed experts in int4 / int8 (fmt): out[T, H] = sum_k weights[t, k] * SwiGLU expert
// ids[t, k] applied to x[t]. gate, up, down and their scales each come as a list: one stack
// ([E, I, row] / [E, H, row], scales [E, rows, blocks]) or one array per expert (wherever each lies).
void moe_experts(Array x, Array ids, Array weights, std::vector<Array> gq, std::vector<Array> gs,
                 std::vector<Array> uq, std::vector<Array> us, std::vector<Array> dq, std::vector<Array> ds,
                 Array out, int fmt, int intermediate) {
    check_efmt(fmt);
    MOERUN_CHECK(!moerun::is_float_fmt(moerun::gate_fmt(fmt)), "fmt: packed experts (moe_experts_float runs float ones)");
    const auto [T, H, K] = routed_tokens(x, ids, weights);
    const auto [ex, I] = expert_table(fmt, H, gq, gs, uq, us, dq, ds);
    MOERUN_CHECK(I == (size_t)intermediate, "gate: dimension 1 must be the expert width");
    check_shape(out, {T, H}, "out");
    run_act(x, out, [&](const float* xp, float* y) {
        moerun::moe_experts(fmt, (int)T, (int)H, (int)I, (int)ex.size(), (int)K, xp, (const int64_t*)ids.data(),
                            (const float*)weights.data(), ex.data(), y);
    });
}

// moe_experts with unquantized weights, all float32 or all bf16 (as uint16); the activations
// stay float32 throughout. gate, up and down each come as a list: one stack ([E, I, H] and
// [E, H, I]) or one array per expert ([I, H] and [H, I], wherever each lies).
void moe_experts_float(Array x, Array ids, Array weights, std::vector<Array> gate, std::vector<Array> up,
                       std::vector<Array> down, Array out) {
    const auto [T, H, K] = routed_tokens(x, ids, weights);
    MOERUN_CHECK(!gate.empty(), "gate: one stack [E, I, H] or one [I, H] array per expert");
    const bool bf16 = is_bf16(gate[0]);
    MOERUN_CHECK(bf16 || gate[0].dtype() == nb::dtype<float>(), "gate: must be float32 or bf16 (as uint16)");
    const int fmt = bf16 ? moerun::FMT_BF16 : moerun::FMT_F32;
    const auto [ex, I] = expert_table(fmt, H, gate, {}, up, {}, down, {});
    check_shape(out, {T, H}, "out");
    run_act(x, out, [&](const float* xp, float* y) {
        moerun::moe_experts(fmt, (int)T, (int)H, (int)I, (int)ex.size(), (int)K, xp, (const int64_t*)ids.data(),
                            (const float*)weights.data(), ex.data(), y);
    });
}

// q [Hq, D]; k [Hkv, S, D] and v [Hkv, S, Dv] may be strided views (a cache's first S
// positions) with unit stride in their last dimension; out [Hq, Dv]. float32 or bf16 keys and
// values, or int8 ones with their scales k_scale, v_scale [Hkv, S, 1] (float32 views too).
void attn_decode(Array q, Strided k, Strided v, Array out, float scale, std::optional<Strided> k_scale,
                 std::optional<Strided> v_scale) {
    check_dtype(q, dtype_code::Float, 32, "q");
    MOERUN_CHECK(q.ndim() == 2, "q must be [Hq, D]");
    const size_t Hq = q.shape(0), D = q.shape(1);
    const bool i8 = k.dtype() == nb::dtype<int8_t>();
    // bf16 arrives as raw 16-bit words (numpy has no bf16): uint16
    const bool bf16 = is_bf16(k);
    MOERUN_CHECK(k.dtype() == v.dtype() && (i8 || bf16 || k.dtype() == nb::dtype<float>()),
                 "k, v: must be both float32, both bf16 (as uint16) or both int8");
    MOERUN_CHECK(i8 == k_scale.has_value() && i8 == v_scale.has_value(),
                 "int8 k, v need k_scale and v_scale (and only they)");
    MOERUN_CHECK(k.ndim() == 3 && v.ndim() == 3, "k, v must be [Hkv, S, D]");
    const size_t Hkv = k.shape(0), S = k.shape(1), Dv = v.shape(2);
    MOERUN_CHECK(Hkv > 0 && S > 0 && Hq % Hkv == 0, "q heads must be a multiple of kv heads, S at least 1");
    MOERUN_CHECK(k.shape(2) == D && v.shape(0) == Hkv && v.shape(1) == S, "k, v: shapes do not match q");
    MOERUN_CHECK(k.stride(2) == 1 && v.stride(2) == 1, "k, v: last dimension must be contiguous");
    check_dtype(out, dtype_code::Float, 32, "out");
    check_shape(out, {Hq, Dv}, "out");
    const float *ks = nullptr, *vs = nullptr;
    long st[4] = {0, 0, 0, 0};
    if (i8) {
        int i = 0;
        for (Strided* sc : {&*k_scale, &*v_scale}) {
            MOERUN_CHECK(sc->dtype() == nb::dtype<float>(), "k_scale, v_scale: must be float32");
            MOERUN_CHECK(sc->ndim() == 3 && sc->shape(0) == Hkv && sc->shape(1) == S && sc->shape(2) == 1,
                         "k_scale, v_scale must be [Hkv, S, 1]");
            st[i++] = (long)sc->stride(0);
            st[i++] = (long)sc->stride(1);
        }
        ks = (const float*)k_scale->data();
        vs = (const float*)v_scale->data();
    }
    run_locked([&] {
        moerun::attn_decode((int)Hq, (int)Hkv, (int)S, (int)D, (int)Dv, (const float*)q.data(), k.data(),
                            (long)k.stride(0), (long)k.stride(1), v.data(), (long)v.stride(0), (long)v.stride(1),
                            scale, (float*)out.data(), i8 ? moerun::KV_I8 : bf16 ? moerun::KV_BF16 : moerun::KV_F32,
                            ks, st[0], st[1], vs, st[2], st[3]);
    });
}

// x [M, D]; w [D], or [G, D] for row m to take w[m % G]; out [M, D]; float32 (x and out may be bf16: ActIn, ActOut)
void rms_norm(Array x, Array w, Array out, float eps, float w_offset) {
    check_dtype(w, dtype_code::Float, 32, "w");
    MOERUN_CHECK(x.ndim() == 2, "x must be [M, D]");
    const size_t M = x.shape(0), D = x.shape(1);
    MOERUN_CHECK((w.ndim() == 1 || (w.ndim() == 2 && w.shape(0) > 0)) && w.shape(w.ndim() - 1) == D,
                 "w must be [D] or [G, D]");
    const size_t G = w.ndim() == 2 ? w.shape(0) : 1;
    MOERUN_CHECK(M % G == 0, "w: the rows must be a multiple of G");
    check_shape(out, {M, D}, "out");
    run_act(x, out, [&](const float* xp, float* y) {
        moerun::rms_norm((int)M, (int)D, xp, (const float*)w.data(), w_offset, eps, y, (int)G);
    });
}

// x [T, H, D]; w [D] or empty (no norm); cos, sin [T, rd]; out [H, T, D]; float32
void norm_rope_heads(Array x, Array w, Array cos, Array sin, Array out, float eps, float w_offset) {
    for (auto [a, name] : {std::pair{&x, "x"}, {&w, "w"}, {&cos, "cos"}, {&sin, "sin"}, {&out, "out"}})
        check_dtype(*a, dtype_code::Float, 32, name);
    MOERUN_CHECK(x.ndim() == 3, "x must be [T, H, D]");
    const size_t T = x.shape(0), H = x.shape(1), D = x.shape(2);
    MOERUN_CHECK(w.ndim() == 1 && (w.shape(0) == D || w.shape(0) == 0), "w must be [D] or empty");
    MOERUN_CHECK(cos.ndim() == 2 && cos.shape(0) == T, "cos must be [T, rd]");
    const size_t rd = cos.shape(1);
    MOERUN_CHECK(rd % 2 == 0 && rd <= D, "the rotary width must be even and at most D");
    check_shape(sin, {T, rd}, "sin");
    check_shape(out, {H, T, D}, "out");
    const float* wp = w.shape(0) ? (const float*)w.data() : nullptr;
    run_locked([&] {
        moerun::norm_rope_heads((int)T, (int)H, (int)D, (const float*)x.data(), wp, w_offset, eps,
                                (const float*)cos.data(), (const float*)sin.data(), (int)rd, (float*)out.data());
    });
}


// x [M, K]; weights[p] [rows_p, bytes] with scales[p] [rows_p, nb] in fmts[p]; out [M, sum rows_p]
void qlinear_multi(Array x, std::vector<Array> weights, std::vector<Array> scales, std::vector<int> fmts, Array out) {
    MOERUN_CHECK(x.ndim() == 2, "x must be [M, K]");
    const size_t M = x.shape(0), K = x.shape(1);
    const size_t P = weights.size();
    MOERUN_CHECK(P >= 1 && scales.size() == P && fmts.size() == P, "one scales tensor and one fmt per weight");
    const int nb = moerun::blocks_of((int)K);
    std::vector<moerun::QWeight> qw;
    std::vector<int> rows;
    size_t N = 0;
    for (size_t p = 0; p < P; ++p) {
        MOERUN_CHECK(weights[p].ndim() == 2, "weights must be [rows, bytes per row]");
        rows.push_back((int)weights[p].shape(0));
        N += weights[p].shape(0);
        qw.push_back(qweight_of(weights[p], scales[p], fmts[p], weights[p].shape(0), K, "weight"));
    }
    check_shape(out, {M, N}, "out");
    run_act(x, out, [&](const float* xp, float* y) {
        moerun::qlinear_multi((int)M, (int)K, (int)P, qw.data(), rows.data(), xp, y);
    });
}

// x [T, H]; router [E, H] float32; ids [T, K] int64 and weights [T, K] float32 are written
// logits [R, V] float32 or bf16 -> out[R] int64 (moerun::greedy_picks); seen, extra int64
void greedy_picks(Array logits, Array seen, Array extra, float penalty, bool extra_per_row, Array out) {
    MOERUN_CHECK(logits.ndim() == 2 && logits.shape(1) >= 1, "logits must be [R, V]");
    const size_t R = logits.shape(0), V = logits.shape(1);
    for (auto [a, name] : {std::pair{&seen, "seen"}, {&extra, "extra"}, {&out, "out"}}) {
        check_dtype(*a, dtype_code::Int, 64, name);
        MOERUN_CHECK(a->ndim() == 1, std::string(name) + " must be 1-D");
    }
    check_shape(out, {R}, "out");
    ActIn x(logits, "logits");
    moerun::greedy_picks(x.p, R, V, (const int64_t*)seen.data(), seen.shape(0), (const int64_t*)extra.data(),
                         extra.shape(0), penalty, extra_per_row, (int64_t*)out.data());
}

// p, q [V] float32 -> a rejected draft's replacement (moerun::residual_draw)
int64_t residual_draw(Array p, Array q, double u) {
    check_dtype(p, dtype_code::Float, 32, "p");
    check_dtype(q, dtype_code::Float, 32, "q");
    MOERUN_CHECK(p.ndim() == 1 && p.shape(0) >= 1, "p must be [V]");
    check_shape(q, {p.shape(0)}, "q");
    MOERUN_CHECK(u >= 0.0 && u < 1.0, "u must be in [0, 1)");
    return moerun::residual_draw((const float*)p.data(), (const float*)q.data(), p.shape(0), u);
}

// logits [V] float32 or bf16 -> the sampled token (moerun::sample_row), or -1 for u < 0;
// probs [V] float32 (or empty) gets the distribution
int64_t sample_row(Array logits, Array seen, Array extra, float penalty, float temperature, int top_k, float top_p,
                   float min_p, float u, Array probs) {
    MOERUN_CHECK(logits.ndim() == 1 && logits.shape(0) >= 1, "logits must be [V]");
    const size_t V = logits.shape(0);
    check_dtype(seen, dtype_code::Int, 64, "seen");
    check_dtype(extra, dtype_code::Int, 64, "extra");
    MOERUN_CHECK(seen.ndim() == 1 && extra.ndim() == 1, "seen and extra must be 1-D");
    MOERUN_CHECK(temperature > 0.f, "temperature must be > 0");
    MOERUN_CHECK(probs.size() == 0 || (probs.ndim() == 1 && probs.shape(0) == V), "probs must be [V] or empty");
    if (probs.size()) check_dtype(probs, dtype_code::Float, 32, "probs");
    ActIn x(logits, "logits");
    return moerun::sample_row(x.p, V, (const int64_t*)seen.data(), seen.shape(0), (const int64_t*)extra.data(),
                              extra.shape(0), penalty, temperature, top_k, top_p, min_p, u,
                              probs.size() ? (float*)probs.data() : nullptr);
}

// grouped routing's settings for E experts, K of them per token
void check_groups(size_t E, int K, int n_group, int topk_group) {
    MOERUN_CHECK(n_group >= 1 && E % (size_t)n_group == 0, "n_group must divide the number of experts");
    MOERUN_CHECK(n_group == 1 || E / (size_t)n_group >= 2, "grouped routing needs at least 2 experts per group");
    MOERUN_CHECK(topk_group >= 1 && topk_group <= n_group, "topk_group must be in 1..n_group");
    MOERUN_CHECK((size_t)K <= (size_t)topk_group * (E / (size_t)n_group),
                 "K must be at most the experts of the topk_group groups");
}

// ids [T, K] int64 and weights [T, K] float32 are written: route_sigmoid_grouped's routing
void route_sigmoid_grouped(Array x, Array router, Array bias, int n_group, int topk_group, float scale, Array ids,
                           Array weights, bool renorm) {
    MOERUN_CHECK(x.ndim() == 2, "x must be [T, H]");
    const size_t T = x.shape(0), H = x.shape(1);
    check_dtype(router, dtype_code::Float, 32, "router");
    MOERUN_CHECK(router.ndim() == 2 && router.shape(1) == H && router.shape(0) >= 1, "router must be [E, H]");
    const size_t E = router.shape(0);
    check_dtype(bias, dtype_code::Float, 32, "bias");
    check_shape(bias, {E}, "bias");
    check_dtype(ids, dtype_code::Int, 64, "ids");
    MOERUN_CHECK(ids.ndim() == 2 && ids.shape(0) == T && ids.shape(1) >= 1 && ids.shape(1) <= E,
                 "ids must be [T, K] with 1 <= K <= experts");
    const size_t K = ids.shape(1);
    check_groups(E, (int)K, n_group, topk_group);
    check_dtype(weights, dtype_code::Float, 32, "weights");
    check_shape(weights, {T, K}, "weights");
    ActIn xin(x, "x");
    const moerun::SigmoidRoute r{(const float*)bias.data(), n_group, topk_group, scale};
    run_locked([&] {
        moerun::route_sigmoid_grouped((int)T, (int)H, (int)E, (int)K, renorm, r, xin.p, (const float*)router.data(),
                                      (int64_t*)ids.data(), (float*)weights.data());
    });
}

void route_softmax_topk(Array x, Array router, Array ids, Array weights, bool renorm) {
    MOERUN_CHECK(x.ndim() == 2, "x must be [T, H]");
    const size_t T = x.shape(0), H = x.shape(1);
    check_dtype(router, dtype_code::Float, 32, "router");
    MOERUN_CHECK(router.ndim() == 2 && router.shape(1) == H && router.shape(0) >= 1, "router must be [E, H]");
    const size_t E = router.shape(0);
    check_dtype(ids, dtype_code::Int, 64, "ids");
    MOERUN_CHECK(ids.ndim() == 2 && ids.shape(0) == T && ids.shape(1) >= 1 && ids.shape(1) <= E,
                 "ids must be [T, K] with 1 <= K <= experts");
    const size_t K = ids.shape(1);
    check_dtype(weights, dtype_code::Float, 32, "weights");
    check_shape(weights, {T, K}, "weights");
    ActIn xin(x, "x");
    run_locked([&] {
        moerun::route_softmax_topk((int)T, (int)H, (int)E, (int)K, renorm, xin.p, (const float*)router.data(),
                                   (int64_t*)ids.data(), (float*)weights.data());
    });
}

// x [M, H]; gate/up [I, bytes] + scales, down [H, bytes] + scales; out [M, H]; gate_vec [H] or empty
void swiglu_mlp(Array x, Array gw, Array gs, int gf, Array uw, Array us, int uf, Array dw, Array ds, int df, Array out,
                Array gate_vec) {
    MOERUN_CHECK(x.ndim() == 2, "x must be [M, H]");
    MOERUN_CHECK(gw.ndim() == 2, "gate must be [I, bytes per row]");
    const size_t M = x.shape(0), H = x.shape(1), I = gw.shape(0);
    auto g = qweight_of(gw, gs, gf, I, H, "gate");
    auto u = qweight_of(uw, us, uf, I, H, "up");
    auto d = qweight_of(dw, ds, df, H, I, "down");
    check_shape(out, {M, H}, "out");
    check_dtype(gate_vec, dtype_code::Float, 32, "gate_vec");
    MOERUN_CHECK(gate_vec.ndim() == 1 && (gate_vec.shape(0) == 0 || gate_vec.shape(0) == H),
                 "gate_vec must be [H] or empty");
    run_act(x, out, [&](const float* xp, float* y) {
        moerun::swiglu_mlp((int)M, (int)H, (int)I, g, u, d, xp, y,
                           gate_vec.shape(0) ? (const float*)gate_vec.data() : nullptr);
    });
}

#include "executors.inc"  // what the layer halves, the MTP head and the layer stack run, checked once

// The MoE half of a decoder layer for a few tokens (moerun::moe_block_decode): out = x +
// experts(h) [+ shared expert(h)], h = RMSNorm(x). x [T, H] and out (float32, or both bf16:
// then every intermediate is rounded as the separate bf16 ops round it); norm_w [H] and
// router [E, H] float32; experts as `expert_table` takes them, in efmt; shared: [] or the
// shared expert's gate, up, down with their scales and fmts (as qlinear_multi's weights);
// shared_gate [H] float32 or empty. h_out [T, H] and w_out [T, K] in x's dtype and ids_out
// [T, K] int64 are filled when not empty (what the separate ops would hand their hooks).
void moe_block(Array x, Array norm_w, float eps, float norm_offset, Array router, int K, bool renorm, Array bias,
               int n_group, int topk_group, float route_scale, int efmt,
               std::vector<Array> gate, std::vector<Array> gs, std::vector<Array> up, std::vector<Array> us,
               std::vector<Array> down, std::vector<Array> ds, nb::object source, std::vector<Array> shared,
               std::vector<Array> shared_s, std::vector<int> shared_fmts, Array shared_gate, Array out, Array h_out,
               Array ids_out, Array w_out, Array seen, nb::object observer) {
    MOERUN_CHECK(x.ndim() == 2, "x must be [T, H]");
    const size_t T = x.shape(0), H = x.shape(1);
    MOERUN_CHECK(is_bf16(x) == is_bf16(out), "x and out: both float32 or both bf16");
    MoeCall c;
    moe_block_args(c, T, H, is_bf16(out), norm_w, eps, norm_offset, router, K, renorm, bias, n_group, topk_group,
                   route_scale, efmt, gate, gs, up, us, down, ds,
                   source, shared, shared_s, shared_fmts, shared_gate, observer);
    check_shape(out, {T, H}, "out");
    moe_observe(c, h_out, ids_out, w_out, seen);
    run_act(x, out, [&](const float* xp, float* y) {
        c.a.x = xp, c.a.y = y;
        moerun::moe_block_decode(c.a);
        moe_observed_finish(c);
    });
}

// The dense MLP half of a decoder layer for a few tokens (moerun::mlp_block_decode): out = x +
// down(silu(gate h) * up h), h = RMSNorm(x). x and out [T, H] float32, or both bf16 (every
// intermediate rounded as the separate bf16 ops round it); norm_w [H] float32; gate, up, down
// as qlinear_multi's weights.
void mlp_block(Array x, Array norm_w, float eps, float norm_offset, Array gw, Array gs, int gf, Array uw, Array us,
               int uf, Array dw, Array ds, int df, Array out) {
    MOERUN_CHECK(x.ndim() == 2, "x must be [T, H]");
    const size_t T = x.shape(0), H = x.shape(1);
    MOERUN_CHECK(is_bf16(x) == is_bf16(out), "x and out: both float32 or both bf16");
    moerun::MlpBlockArgs a = mlp_block_args(T, H, is_bf16(out), norm_w, eps, norm_offset, gw, gs, gf, uw, us, uf, dw,
                                            ds, df);
    check_shape(out, {T, H}, "out");
    run_act(x, out, [&](const float* xp, float* y) {
        a.x = xp, a.y = y;
        moerun::mlp_block_decode(a);
    });
}

// x [T, H] and out [T, H] (float32, or bf16: then with in_norm both bf16) through
// attn_block_args' attention.
void attn_block_decode(Array x, Array qw, Array qs, int qf, Array kw, Array ks, int kf, Array vw, Array vs, int vf,
                       Array ow, Array os, int of, Array qn, Array kn, float eps, Array cos, Array sin, Array kc,
                       Array vc, int pos, int Hq, float scale, Array out, bool gated,
                       std::optional<Array> in_norm, float in_offset, float in_eps, std::optional<Array> qkv_bias,
                       int window) {
    MOERUN_CHECK(x.ndim() == 2 && x.shape(0) >= 1, "x must be [T, H]");
    const size_t T = x.shape(0), H = x.shape(1);
    check_shape(out, {T, H}, "out");
    if (in_norm) MOERUN_CHECK(is_bf16(x) == is_bf16(out), "with in_norm, x and out: both float32 or both bf16");
    const moerun::AttnBlockArgs a = attn_block_args(T, H, qw, qs, qf, kw, ks, kf, vw, vs, vf, ow, os, of, qn, kn, eps,
                                                    cos, sin, kc, vc, pos, Hq, scale, gated, in_norm, in_offset, in_eps,
                                                    is_bf16(out), qkv_bias, window);
    run_act(x, out, [&](const float* xp, float* y) { moerun::attn_block_decode(a, xp, y); });
}

// A batch's decode step through a fused attention: row t of x [T, H] is a row of its own, its
// keys and values at slot slots[t] of the whole cache (kc, vc [slots, kv heads, max_len, D]) at
// position pos[t] (int64 [T] each); cos, sin [T, rd] its rope row. Otherwise as
// attn_block_decode, whose one-row call each row's arithmetic equals.
void attn_block_rows(Array x, Array qw, Array qs, int qf, Array kw, Array ks, int kf, Array vw, Array vs, int vf,
                     Array ow, Array os, int of, Array qn, Array kn, float eps, Array cos, Array sin, Array kc,
                     Array vc, Array slots, Array pos, int Hq, float scale, Array out, bool gated,
                     std::optional<Array> in_norm, float in_offset, float in_eps, std::optional<Array> qkv_bias,
                     int window) {
    MOERUN_CHECK(x.ndim() == 2 && x.shape(0) >= 1, "x must be [T, H]");
    const size_t T = x.shape(0), H = x.shape(1);
    check_shape(out, {T, H}, "out");
    if (in_norm) MOERUN_CHECK(is_bf16(x) == is_bf16(out), "with in_norm, x and out: both float32 or both bf16");
    MOERUN_CHECK(kc.ndim() == 4, "k cache must be [slots, kv heads, max_len, D]");
    const size_t S = kc.shape(0), Hkv = kc.shape(1), L = kc.shape(2), D = kc.shape(3);
    check_shape(vc, {S, Hkv, L, D}, "v cache");
    // the arguments as for slot 0 at position 0, then each row's slot and position
    const size_t slot_shape[3] = {Hkv, L, D};
    Array k0(kc.data(), 3, slot_shape, nb::handle(), nullptr, kc.dtype()),
        v0(vc.data(), 3, slot_shape, nb::handle(), nullptr, vc.dtype());  // (views for the call: kc, vc own them)
    moerun::AttnBlockArgs a = attn_block_args(T, H, qw, qs, qf, kw, ks, kf, vw, vs, vf, ow, os, of, qn, kn, eps, cos,
                                              sin, k0, v0, 0, Hq, scale, gated, in_norm, in_offset, in_eps,
                                              is_bf16(out), qkv_bias, window);
    for (const Array* r : {&slots, &pos}) {
        check_dtype(*r, dtype_code::Int, 64, "slots, pos");
        check_shape(*r, {T}, "slots, pos");
    }
    std::vector<long> off(T);
    std::vector<int> at(T);
    for (size_t t = 0; t < T; ++t) {
        const int64_t sl = ((const int64_t*)slots.data())[t], p = ((const int64_t*)pos.data())[t];
        MOERUN_CHECK(sl >= 0 && (size_t)sl < S, "a slot outside the cache");
        MOERUN_CHECK(p >= 0 && (size_t)p < L, "position outside the cache");
        off[t] = (long)(sl * Hkv * L * D);
        at[t] = (int)p;
    }
    a.row_off = off.data();
    a.row_pos = at.data();
    run_act(x, out, [&](const float* xp, float* y) { moerun::attn_block_decode(a, xp, y); });
}



// DeepSeek-V3's attention half (MLA) for B rows of T tokens (moerun::mla_block_decode): x and
// out [B * T, H], both float32 or both bf16 (then every intermediate the module hands on in
// bf16 is rounded so); row b's tokens at slot slots[b], positions pos[b], pos[b] + 1, ... of
// the whole cache [slots, 1, max_len, R + Dr]; cos, sin [B * T, Dr] their rope rows; the
// weights as `mla_args` takes them; in_norm [H] or empty (out = x + block(RMSNorm(x))).
void mla_block(Array x, Array qaw, Array qas, int qaf, Array qbw, Array qbs, int qbf, Array kvw, Array kvs, int kvf,
               Array ow, Array os, int of, Array qa_bias, Array kva_bias, Array o_bias, Array q_norm, float q_eps,
               Array kv_norm, float kv_eps, Array wkb, Array kvb, Array cos, Array sin, Array cache, Array slots,
               Array pos, int N, float scale, bool interleaved, Array out, Array in_norm, float in_offset,
               float in_eps) {
    MOERUN_CHECK(x.ndim() == 2 && x.shape(0) >= 1, "x must be [B * T, H]");
    const size_t M = x.shape(0), H = x.shape(1);
    check_shape(out, {M, H}, "out");
    MOERUN_CHECK(is_bf16(x) == is_bf16(out), "x and out: both float32 or both bf16");
    for (const Array* r : {&slots, &pos}) {
        check_dtype(*r, dtype_code::Int, 64, "slots, pos");
        MOERUN_CHECK(r->ndim() == 1, "slots, pos must be [B]");
    }
    const size_t B = slots.shape(0);
    MOERUN_CHECK(B >= 1 && pos.shape(0) == B && M % B == 0, "slots, pos: one per row, x's tokens B * T");
    size_t slot_elems = 0;
    moerun::MlaArgs a = mla_args(M, H, qaw, qas, qaf, qbw, qbs, qbf, kvw, kvs, kvf, ow, os, of, qa_bias, kva_bias,
                                 o_bias, q_norm, q_eps, kv_norm, kv_eps, wkb, kvb, cache, N, scale, interleaved,
                                 in_norm, in_offset, in_eps, is_bf16(out), slot_elems);
    std::vector<long> off;
    std::vector<int> at;
    mla_rows(a, slot_elems, cache.shape(0), B, M / B, (const int64_t*)slots.data(), (const int64_t*)pos.data(), cos,
             sin, off, at);
    run_act(x, out, [&](const float* xp, float* y) { moerun::mla_block_decode(a, xp, y); });
}

// qkv [B, T, C]; a, b [B, T, Hv]; z, out [B, T, Hv, Dv]: float32 or bf16 (a bf16 model's
// activations: widened exactly, out rounded); the weights and states as `delta_args` takes
// them. conv and S end as the state after the last token. qkv, a, b and z may be strided
// over their first two dimensions (column slices of one projection buffer).
void deltanet_decode(Strided qkv, Array conv_w, Array conv, std::optional<Array> conv_every, Strided a,
                     Strided b, Array A_log, Array dt_bias, Array S, std::optional<Array> S_every, Strided z,
                     Array norm_w, float eps, Array out, int Hk) {
    for (const Strided* t : {&qkv, &a, &b, &z})  // activations: float32, or a bf16 model's (uint16)
        MOERUN_CHECK(t->dtype() == nb::dtype<float>() || is_bf16(*t), "deltanet tensors: wrong dtype");
    MOERUN_CHECK(qkv.ndim() == 3, "qkv must be [B, T, C]");
    const size_t B = qkv.shape(0), T = qkv.shape(1), C = qkv.shape(2);
    moerun::DeltaArgs d = delta_args(B, T, C, conv_w, conv, conv_every, A_log, dt_bias, S, S_every, norm_w, eps, Hk);
    const size_t Hv = d.Hv, Dv = d.Dv;
    check_rows(qkv, {B, T, C}, "qkv");
    check_rows(a, {B, T, Hv}, "a");
    check_rows(b, {B, T, Hv}, "b");
    check_rows(z, {B, T, Hv, Dv}, "z");
    check_shape(out, {B, T, Hv, Dv}, "out");
    thread_local std::vector<float> bufs[4];
    const RowsIn xq = rows_in(qkv, bufs[0], "qkv"), xa = rows_in(a, bufs[1], "a"), xb = rows_in(b, bufs[2], "b"),
                 xz = rows_in(z, bufs[3], "z");
    auto take = [](const RowsIn& r, const float*& p, long& sb, long& st) { p = r.p, sb = r.s0, st = r.s1; };
    take(xq, d.qkv, d.qkv_sb, d.qkv_st);
    take(xa, d.a, d.a_sb, d.a_st);
    take(xb, d.b, d.b_sb, d.b_st);
    take(xz, d.z, d.z_sb, d.z_st);
    run_out(out, [&](float* y) {
        d.out = y;
        moerun::deltanet_decode(d);
    });
}

// The chunked gated delta rule on its own (moerun::delta_rule_chunked): q, k [B, T, Hk, Dk],
// v [B, T, Hv, Dv], g, beta [B, T, Hv], S [B, Hv, Dk, Dv] (in place), out [B, T, Hv, Dv]; float32
void delta_rule_chunked(Array q, Array k, Array v, Array g, Array beta, Array S, Array out) {
    for (auto [t, name] : {std::pair{&q, "q"}, {&k, "k"}, {&v, "v"}, {&g, "g"}, {&beta, "beta"}, {&S, "S"},
                           {&out, "out"}})
        check_dtype(*t, dtype_code::Float, 32, name);
    MOERUN_CHECK(q.ndim() == 4, "q must be [B, T, Hk, Dk]");
    const size_t B = q.shape(0), T = q.shape(1), Hk = q.shape(2), Dk = q.shape(3);
    MOERUN_CHECK(v.ndim() == 4 && v.shape(0) == B && v.shape(1) == T, "v must be [B, T, Hv, Dv]");
    const size_t Hv = v.shape(2), Dv = v.shape(3);
    MOERUN_CHECK(Hk >= 1 && Hv % Hk == 0, "the value heads must be a multiple of the key heads");
    MOERUN_CHECK(T >= 1 && Dk >= 1 && Dv >= 1, "empty q or v");
    check_shape(k, {B, T, Hk, Dk}, "k");
    check_shape(g, {B, T, Hv}, "g");
    check_shape(beta, {B, T, Hv}, "beta");
    check_shape(S, {B, Hv, Dk, Dv}, "S");
    check_shape(out, {B, T, Hv, Dv}, "out");
    run_locked([&] {
        moerun::delta_rule_chunked((int)B, (int)T, (int)Hk, (int)Hv, (int)Dk, (int)Dv, (const float*)q.data(),
                                   (const float*)k.data(), (const float*)v.data(), (const float*)g.data(),
                                   (const float*)beta.data(), (float*)S.data(), (float*)out.data());
    });
}

// silu in place over a contiguous float32 array (moerun::silu_rows: the vectorized form the
// DeltaNet conv, its gated norm and the MLPs' activation take), for its test against torch
void silu_inplace(Array y) {
    check_dtype(y, dtype_code::Float, 32, "y");
    nb::gil_scoped_release release;
    OpLock lk;
    moerun::silu_rows((float*)y.data(), (long)y.size());
}

// The linear-attention half of a Qwen3.5 decoder layer (moerun::deltanet_block_decode):
// out = x + out_proj(DeltaNet(projections of RMSNorm(x))). x, out [B, T, H], both float32 or
// both bf16; norm_w [H] float32; proj: in_proj_qkv, in_proj_z, in_proj_a, in_proj_b (weights,
// scales, fmts as qlinear_multi takes them; rows C, Hv * Dv, Hv, Hv); out_proj [H rows of
// Hv * Dv]; the DeltaNet's weights and states as `delta_args` takes them.
void deltanet_block(Array x, Array norm_w, float norm_offset, float norm_eps, std::vector<Array> proj,
                    std::vector<Array> proj_s, std::vector<int> proj_fmts, Array ow, Array os, int of, Array conv_w,
                    Array conv, std::optional<Array> conv_every, Array A_log, Array dt_bias, Array S,
                    std::optional<Array> S_every, Array gnorm_w, float eps, Array out, int Hk) {
    MOERUN_CHECK(x.ndim() == 3, "x must be [B, T, H]");
    const size_t B = x.shape(0), T = x.shape(1), H = x.shape(2);
    MOERUN_CHECK(is_bf16(x) == is_bf16(out), "x and out: both float32 or both bf16");
    check_shape(out, {B, T, H}, "out");
    moerun::DeltaBlockArgs a = deltanet_block_args(B, T, H, is_bf16(out), norm_w, norm_offset, norm_eps, proj, proj_s,
                                                   proj_fmts, ow, os, of, conv_w, conv, conv_every, A_log, dt_bias, S,
                                                   S_every, gnorm_w, eps, Hk);
    run_act(x, out, [&](const float* xp, float* y) {
        a.x = xp, a.y = y;
        moerun::deltanet_block_decode(a);
    });
}


std::vector<std::string> available_isas() {
    const moerun::KernelTable* all[8];
    int n = moerun::supported_kernels(all);
    std::vector<std::string> r;
    for (int i = 0; i < n; ++i) r.push_back(all[i]->name);
    return r;
}

void set_isa(const std::string& name) {
    OpLock lk;
    if (!moerun::set_isa(name.c_str())) throw std::invalid_argument("ISA " + name + " is unknown or not supported by this CPU");
}

void set_threads(int n) {
    MOERUN_CHECK(n >= 1, "threads must be at least 1");
    run_locked([&] { moerun::set_threads(n); });
}

// For tests of the pool's logic (tests/test_thread_pool.py): `jobs` jobs of n_tasks tasks on the
// process's pool, each task counted where it ran. hold: the workers are held up before they take
// a task (as if descheduled), so the calling thread must run every task; throw_task >= 0: that
// task of the first job throws (the exception must reach the caller after the job, and the pool
// stay usable); worker_sleep_us: a task run by a worker first sleeps this long (a worker held up
// in the middle of a task). Returns each task's run count summed over the jobs, the tasks the
// calling thread ran, and whether the first job's exception arrived.
nb::dict pool_check(int n_tasks, int jobs, bool hold, int throw_task, int worker_sleep_us) {
    MOERUN_CHECK(n_tasks >= 0 && jobs >= 0 && worker_sleep_us >= 0, "pool_check: counts must be >= 0");
    std::vector<std::atomic<int>> counts(n_tasks);
    for (auto& c : counts) c.store(0);
    std::atomic<long> by_caller{0};
    bool raised = false;
    {
        nb::gil_scoped_release release;
        std::lock_guard<std::mutex> lk(g_op_mutex);
        moerun::ThreadPool& p = moerun::pool();
        p.hold_workers(hold);
        for (int j = 0; j < jobs; ++j) {
            try {
                p.parallel_for(n_tasks, [&](int t) {
                    const bool caller = moerun::ThreadPool::on_caller() || p.size() == 1 || n_tasks == 1;
                    if (!caller && worker_sleep_us) std::this_thread::sleep_for(std::chrono::microseconds(worker_sleep_us));
                    counts[t].fetch_add(1, std::memory_order_relaxed);
                    if (caller) by_caller.fetch_add(1, std::memory_order_relaxed);
                    if (j == 0 && t == throw_task) throw std::runtime_error("pool_check: task threw");
                });
            } catch (const std::runtime_error&) {
                raised = true;
            }
        }
        p.hold_workers(false);
    }
    std::vector<int> out(n_tasks);
    for (int t = 0; t < n_tasks; ++t) out[t] = counts[t].load();
    nb::dict d;
    d["counts"] = out;
    d["by_caller"] = by_caller.load();
    d["raised"] = raised;
    return d;
}

}  // namespace

NB_MODULE(_native, m) {
    m.doc() = "moerun native CPU kernels";
    m.def("cpu_features", &cpu_features, "CPU instruction-set extensions this process can use");
    m.def("available_isas", &available_isas, "kernel paths this CPU can run, slowest first");
    m.def("set_isa", &set_isa, nb::arg("name"), "choose the kernel path (generic, avx2, avxvnni, avx512vnni)");
    m.def("isa", [] { return std::string(moerun::current_isa()); }, "the kernel path in use");
    m.def("set_threads", &set_threads, nb::arg("n"), "size of the native thread pool");
    m.def("get_threads", &moerun::get_threads, "size of the native thread pool");
    m.def("set_spin_us", &moerun::set_spin_us, nb::arg("us"), "how long idle workers spin before they sleep");
    m.def("set_watch_shared", &moerun::set_watch_shared, nb::arg("on"),
          "whether the pool watches for a shared CPU (off while torch's own threads run beside it)");
    m.def("get_spin_us", &moerun::get_spin_us, "how long idle workers spin before they sleep");
    m.def("pool_check", &pool_check, nb::arg("n_tasks"), nb::arg("jobs") = 1, nb::arg("hold") = false,
          nb::arg("throw_task") = -1, nb::arg("worker_sleep_us") = 0, "tests: jobs on the pool, each task counted");
    m.def("pool_stats", [] { return moerun::pool().stats(); },
          "the pool's counts: [signs of a shared CPU: gaps in a spin, the calling thread's run delay, a worker's; "
          "tasks run by workers; stuck jobs a napping worker took; jobs that woke sleeping workers]");
    m.def("cpu_shared", [] { return moerun::pool().cpu_shared(); },
          "whether a pool thread saw the CPU shared (descheduled while it waited or worked) within the last 200 ms");
    m.def("qlinear", &qlinear, nb::arg("x"), nb::arg("w"), nb::arg("scales"), nb::arg("out"), nb::arg("fmt"),
          "out[M, N] = x[M, K] @ W^T with W quantized (fmt 4 or 8, blocks of 32)");
    m.def("qlinear_multi", &qlinear_multi, nb::arg("x"), nb::arg("weights"), nb::arg("scales"), nb::arg("fmts"),
          nb::arg("out"), "several quantized linears of one input in one call: out = [x W_0^T | x W_1^T | ...]");
    m.def("swiglu_mlp", &swiglu_mlp, nb::arg("x"), nb::arg("gw"), nb::arg("gs"), nb::arg("gf"), nb::arg("uw"),
          nb::arg("us"), nb::arg("uf"), nb::arg("dw"), nb::arg("ds"), nb::arg("df"), nb::arg("out"), nb::arg("gate_vec"),
          "out[M, H] = down(silu(gate x) * up x) with quantized gate, up, down; each row times sigmoid(x . gate_vec) "
          "when gate_vec is not empty");
    m.def("greedy_picks", &greedy_picks, nb::arg("logits"), nb::arg("seen"), nb::arg("extra"), nb::arg("penalty"),
          nb::arg("extra_per_row"), nb::arg("out"),
          "each row's first maximum with the repetition penalty on seen (and extra[:j], or all of extra)");
    m.def("residual_draw", &residual_draw, nb::arg("p"), nb::arg("q"), nb::arg("u"),
          "a rejected draft's replacement from norm(max(0, p - q)) (moerun::residual_draw)");
    m.def("sample_row", &sample_row, nb::arg("logits"), nb::arg("seen"), nb::arg("extra"), nb::arg("penalty"),
          nb::arg("temperature"), nb::arg("top_k"), nb::arg("top_p"), nb::arg("min_p"), nb::arg("u"), nb::arg("probs"),
          "a token drawn from one row of logits through the penalty, temperature, top-k, top-p and min-p");
    m.def("route_softmax_topk", &route_softmax_topk, nb::arg("x"), nb::arg("router"), nb::arg("ids"), nb::arg("weights"),
          nb::arg("renorm"), "softmax top-k routing of a few tokens: ids, weights [T, K] of the most probable experts");
    m.def("route_sigmoid_grouped", &route_sigmoid_grouped, nb::arg("x"), nb::arg("router"), nb::arg("bias"),
          nb::arg("n_group"), nb::arg("topk_group"), nb::arg("scale"), nb::arg("ids"), nb::arg("weights"),
          nb::arg("renorm"),
          "grouped sigmoid routing of a few tokens (DeepSeek-V3): ids, weights [T, K]; bias picks, does not weigh");
    m.def("attn_decode", &attn_decode, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("out"), nb::arg("scale"),
          nb::arg("k_scale") = nb::none(), nb::arg("v_scale") = nb::none(),
          "one query token's attention over cached keys/values (grouped query heads)");
    m.def("attn_block_rows", &attn_block_rows, nb::arg("x"), nb::arg("qw"), nb::arg("qs"), nb::arg("qf"),
          nb::arg("kw"), nb::arg("ks"), nb::arg("kf"), nb::arg("vw"), nb::arg("vs"), nb::arg("vf"), nb::arg("ow"),
          nb::arg("os"), nb::arg("of"), nb::arg("qn"), nb::arg("kn"), nb::arg("eps"), nb::arg("cos"), nb::arg("sin"),
          nb::arg("kc"), nb::arg("vc"), nb::arg("slots"), nb::arg("pos"), nb::arg("hq"), nb::arg("scale"),
          nb::arg("out"), nb::arg("gated") = false, nb::arg("in_norm").none() = nb::none(), nb::arg("in_offset") = 0.f,
          nb::arg("in_eps") = 1e-6f, nb::arg("qkv_bias").none() = nb::none(), nb::arg("window") = 0,
          "a batch's decode step through a fused attention block: row t of x at slot slots[t], position pos[t] of the "
          "whole cache; each row's arithmetic that of attn_block_decode on it alone");
    m.def("attn_block_decode", &attn_block_decode, nb::arg("x"), nb::arg("qw"), nb::arg("qs"), nb::arg("qf"),
          nb::arg("kw"), nb::arg("ks"), nb::arg("kf"), nb::arg("vw"), nb::arg("vs"), nb::arg("vf"), nb::arg("ow"),
          nb::arg("os"), nb::arg("of"), nb::arg("qn"), nb::arg("kn"), nb::arg("eps"), nb::arg("cos"), nb::arg("sin"),
          nb::arg("kc"), nb::arg("vc"), nb::arg("pos"), nb::arg("hq"), nb::arg("scale"), nb::arg("out"),
          nb::arg("gated") = false, nb::arg("in_norm").none() = nb::none(), nb::arg("in_offset") = 0.f,
          nb::arg("in_eps") = 1e-6f, nb::arg("qkv_bias").none() = nb::none(), nb::arg("window") = 0,
          "a few tokens of one row through a quantized GQA attention block with a float32 or bf16 cache (gated: Qwen3.5's "
          "sigmoid output gate, q_proj giving each head's query then its gate); with in_norm [H], a decoder layer's "
          "first half: out = x + block(RMSNorm(x)); qkv_bias: the q/k/v projections' biases (Qwen2-MoE); qn [hq * D] "
          "and kn [kv heads * D]: q/k norms across all heads (OLMoE); window > 0: attend to the last window positions");
    m.def("mla_block", &mla_block, nb::arg("x"), nb::arg("qaw"), nb::arg("qas"), nb::arg("qaf"), nb::arg("qbw"),
          nb::arg("qbs"), nb::arg("qbf"), nb::arg("kvw"), nb::arg("kvs"), nb::arg("kvf"), nb::arg("ow"), nb::arg("os"),
          nb::arg("of"), nb::arg("qa_bias"), nb::arg("kva_bias"), nb::arg("o_bias"), nb::arg("q_norm"),
          nb::arg("q_eps"), nb::arg("kv_norm"), nb::arg("kv_eps"), nb::arg("wkb"), nb::arg("kvb"), nb::arg("cos"),
          nb::arg("sin"), nb::arg("cache"), nb::arg("slots"), nb::arg("pos"), nb::arg("heads"), nb::arg("scale"),
          nb::arg("interleaved"), nb::arg("out"), nb::arg("in_norm"), nb::arg("in_offset") = 0.f,
          nb::arg("in_eps") = 1e-6f,
          "DeepSeek-V3's attention half (MLA, W_kb and W_vb absorbed) for B rows of a few tokens over a cache of "
          "joined [latent | rope key] rows; with in_norm [H], out = x + block(RMSNorm(x))");
    m.def("norm_rope_heads", &norm_rope_heads, nb::arg("x"), nb::arg("w"), nb::arg("cos"), nb::arg("sin"),
          nb::arg("out"), nb::arg("eps"), nb::arg("w_offset") = 0.f,
          "out[H, T, D] = rope(RMSNorm(x[T, H, D]) * (w + w_offset)) per head (w empty: no norm), rotate-half on "
          "the first cos.shape[1] dims");
    m.def("rms_norm", &rms_norm, nb::arg("x"), nb::arg("w"), nb::arg("out"), nb::arg("eps"), nb::arg("w_offset") = 0.f,
          "out = x / rms(x) * (w + w_offset) per row (float32)");
    m.def("deltanet_decode", &deltanet_decode, nb::arg("qkv"), nb::arg("conv_w"), nb::arg("conv"),
          nb::arg("conv_every").none(), nb::arg("a"), nb::arg("b"), nb::arg("A_log"), nb::arg("dt_bias"), nb::arg("S"),
          nb::arg("S_every").none(), nb::arg("z"), nb::arg("norm_w"), nb::arg("eps"), nb::arg("out"), nb::arg("hk"),
          "a few tokens per row through a Gated DeltaNet layer's conv, delta rule and gated norm (float32)");
    m.def("silu_inplace", &silu_inplace, nb::arg("y"), "y = silu(y) in place (contiguous float32), vectorized");
    m.def("delta_rule_chunked", &delta_rule_chunked, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("g"),
          nb::arg("beta"), nb::arg("S"), nb::arg("out"),
          "the chunked gated delta rule over whole sequences (q, k L2-normalised here; S updated in place; float32)");
    m.def("moe_block", &moe_block, nb::arg("x"), nb::arg("norm_w"), nb::arg("eps"), nb::arg("norm_offset"),
          nb::arg("router"), nb::arg("k"), nb::arg("renorm"), nb::arg("bias"), nb::arg("n_group"),
          nb::arg("topk_group"), nb::arg("route_scale"), nb::arg("efmt"), nb::arg("gate"), nb::arg("gate_scales"),
          nb::arg("up"), nb::arg("up_scales"), nb::arg("down"), nb::arg("down_scales"),
          nb::arg("source").none(), nb::arg("shared"), nb::arg("shared_scales"), nb::arg("shared_fmts"), nb::arg("shared_gate"), nb::arg("out"), nb::arg("h_out"),
          nb::arg("ids_out"), nb::arg("w_out"), nb::arg("seen"), nb::arg("observer").none() = nb::none(),
          "the MoE half of a decoder layer for a few tokens: out = x + experts(h) [+ shared expert(h)], h = RMSNorm(x), "
          "softmax top-k routing, or grouped sigmoid routing with a bias [E]; observer(h, ids, weights) is called once the router has picked");
    m.def("mlp_block", &mlp_block, nb::arg("x"), nb::arg("norm_w"), nb::arg("eps"), nb::arg("norm_offset"),
          nb::arg("gw"), nb::arg("gs"), nb::arg("gf"), nb::arg("uw"), nb::arg("us"), nb::arg("uf"), nb::arg("dw"),
          nb::arg("ds"), nb::arg("df"), nb::arg("out"),
          "the dense MLP half of a decoder layer for a few tokens: out = x + swiglu(RMSNorm(x))");
    m.def("deltanet_block", &deltanet_block, nb::arg("x"), nb::arg("norm_w"), nb::arg("norm_offset"),
          nb::arg("norm_eps"), nb::arg("proj"), nb::arg("proj_scales"), nb::arg("proj_fmts"), nb::arg("ow"),
          nb::arg("os"), nb::arg("of"), nb::arg("conv_w"), nb::arg("conv"), nb::arg("conv_every").none(),
          nb::arg("A_log"), nb::arg("dt_bias"), nb::arg("S"), nb::arg("S_every").none(), nb::arg("gnorm_w"),
          nb::arg("eps"), nb::arg("out"), nb::arg("hk"),
          "the linear-attention half of a Qwen3.5 decoder layer for a few tokens per row: out = x + "
          "out_proj(DeltaNet(projections of RMSNorm(x)))");
    nb::class_<NativeStack>(m, "NativeStack", "a run's layer stack for one pass shape: the halves' arguments checked once")
        .def(nb::init<size_t, size_t, size_t, bool>(), nb::arg("B"), nb::arg("T"), nb::arg("H"), nb::arg("bf16"))
        .def("add_attention", &NativeStack::add_attention, nb::arg("qw"), nb::arg("qs"), nb::arg("qf"), nb::arg("kw"),
             nb::arg("ks"), nb::arg("kf"), nb::arg("vw"), nb::arg("vs"), nb::arg("vf"), nb::arg("ow"), nb::arg("os"),
             nb::arg("of"), nb::arg("qn"), nb::arg("kn"), nb::arg("eps"), nb::arg("cos"), nb::arg("sin"), nb::arg("kc"),
             nb::arg("vc"), nb::arg("pos"), nb::arg("hq"), nb::arg("scale"), nb::arg("gated"), nb::arg("in_norm"),
             nb::arg("in_offset"), nb::arg("in_eps"), nb::arg("qkv_bias").none() = nb::none(), nb::arg("window") = 0)
        .def("add_mla", &NativeStack::add_mla, nb::arg("qaw"), nb::arg("qas"), nb::arg("qaf"), nb::arg("qbw"),
             nb::arg("qbs"), nb::arg("qbf"), nb::arg("kvw"), nb::arg("kvs"), nb::arg("kvf"), nb::arg("ow"),
             nb::arg("os"), nb::arg("of"), nb::arg("qa_bias"), nb::arg("kva_bias"), nb::arg("o_bias"),
             nb::arg("q_norm"), nb::arg("q_eps"), nb::arg("kv_norm"), nb::arg("kv_eps"), nb::arg("wkb"),
             nb::arg("kvb"), nb::arg("cache"), nb::arg("heads"), nb::arg("scale"), nb::arg("interleaved"),
             nb::arg("in_norm"), nb::arg("in_offset"), nb::arg("in_eps"))
        .def("add_deltanet", &NativeStack::add_deltanet)
        .def("add_moe", &NativeStack::add_moe, nb::arg("norm_w"), nb::arg("eps"), nb::arg("norm_offset"),
             nb::arg("router"), nb::arg("k"), nb::arg("renorm"), nb::arg("bias"), nb::arg("n_group"),
          nb::arg("topk_group"), nb::arg("route_scale"), nb::arg("efmt"), nb::arg("gate"), nb::arg("gate_scales"),
             nb::arg("up"), nb::arg("up_scales"), nb::arg("down"), nb::arg("down_scales"), nb::arg("source").none(),
             nb::arg("shared"), nb::arg("shared_scales"), nb::arg("shared_fmts"), nb::arg("shared_gate"),
             nb::arg("observer").none() = nb::none())
        .def("add_mlp", &NativeStack::add_mlp, nb::arg("norm_w"), nb::arg("eps"), nb::arg("norm_offset"),
             nb::arg("gw"), nb::arg("gs"), nb::arg("gf"), nb::arg("uw"), nb::arg("us"), nb::arg("uf"), nb::arg("dw"),
             nb::arg("ds"), nb::arg("df"))
        .def("run", &NativeStack::run, nb::arg("x"), nb::arg("a"), nb::arg("b"), nb::arg("cos"), nb::arg("sin"),
             nb::arg("slots"), nb::arg("pos"), nb::arg("conv_every"), nb::arg("S_every"), nb::arg("seen"));
    nb::class_<NativeMtp>(m, "NativeMtp", "a one-layer MTP head's calls on one cache slot: its arguments checked once")
        .def(nb::init<Array, Array, float, Array, Array, int, Array, Array, int, Array, Array, int, Array, Array, int,
                      Array, Array, int, Array, Array, float, Array, Array, Array, Array, int, float, bool, Array, float,
                      float, Array, float, float, Array, int, bool, Array, int, int, float, int, std::vector<Array>,
                      std::vector<Array>,
                      std::vector<Array>, std::vector<Array>, std::vector<Array>, std::vector<Array>,
                      std::optional<nb::object>, std::vector<Array>, std::vector<Array>, std::vector<int>, Array, Array, float, float, Array,
                      Array, int>())
        .def("run", &NativeMtp::run, nb::arg("tokens"), nb::arg("hidden"), nb::arg("cos"), nb::arg("sin"),
             nb::arg("pos"), nb::arg("h_out"), nb::arg("ids_out"), nb::arg("w_out"), nb::arg("seen"), nb::arg("h"),
             nb::arg("logits"), "one draft step over T tokens (moerun::mtp_step_decode)")
;
    m.def("moe_experts_float", &moe_experts_float, nb::arg("x"), nb::arg("ids"), nb::arg("weights"), nb::arg("gate"),
          nb::arg("up"), nb::arg("down"), nb::arg("out"), "fused routed experts with float32 or bf16 weights");
    m.def("moe_experts", &moe_experts, nb::arg("x"), nb::arg("ids"), nb::arg("weights"), nb::arg("gate"),
          nb::arg("gate_scales"), nb::arg("up"), nb::arg("up_scales"), nb::arg("down"), nb::arg("down_scales"),
          nb::arg("out"), nb::arg("fmt"), nb::arg("intermediate"),
          "out[T, H] = sum_k weights[t, k] * SwiGLU expert ids[t, k] applied to x[t], quantized experts (each weight "
          "a list: one stack or one array per expert)");
}
