// The one binding file of moerun's native extension. Kernels live in their own files;
// this file only exposes them to Python with typed signatures.
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

// Native ops run one at a time: they share their workspaces and the thread pool. An op that
// calls back into Python (an expert source, a route observer) holds the lock meanwhile, and a
// native op called from that callback on the same thread would wait for itself forever: it is
// refused with an error instead.
static std::mutex g_op_mutex;
static thread_local bool t_in_op = false;

struct OpLock {
    OpLock() {
        if (t_in_op)
            throw std::runtime_error("a native op was called from inside another (an expert source or a route "
                                     "observer must not call moerun's native ops)");
        g_op_mutex.lock();
        t_in_op = true;
    }
    ~OpLock() {
        t_in_op = false;
        g_op_mutex.unlock();
    }
    OpLock(const OpLock&) = delete;
    OpLock& operator=(const OpLock&) = delete;
};

namespace {

using nb::dlpack::dtype_code;

// A failed check throws its message (one line on the Python side); the message is built only
// then: built every time, a decode step's few hundred checks cost microseconds of string work.
#define MOERUN_CHECK(ok, msg)                        \
    do {                                             \
        if (!(ok)) throw std::invalid_argument(msg); \
    } while (0)

void check_dtype(const Array& a, dtype_code code, int bits, const char* what) {
    MOERUN_CHECK(a.dtype().code == (uint8_t)code && a.dtype().bits == bits && a.dtype().lanes == 1,
                 std::string(what) + ": wrong dtype");
}

// Activations in a bf16 model's dtype: an op's x and out may be bf16 (passed as their bits,
// uint16) as well as float32. x is widened exactly into a per-thread buffer; the op writes
// float32 into another and out gets it rounded to nearest even (as torch's .to(bfloat16)).
// Bit-identical to converting in torch around a float32 call, without the two torch
// conversions (~3-7 us each, several per layer of a decode step).
template <class A>  // Array or Strided
bool is_bf16(const A& a) { return a.dtype() == nb::dtype<uint16_t>(); }

// n bf16 values (their bits) widened exactly to float32
void widen_bf16(const uint16_t* s, float* d, size_t n) {
    for (size_t i = 0; i < n; ++i) {
        const uint32_t u = (uint32_t)s[i] << 16;
        std::memcpy(&d[i], &u, 4);
    }
}

struct ActIn {
    const float* p;
    ActIn(const Array& a, const char* what) {
        if (!is_bf16(a)) {
            check_dtype(a, dtype_code::Float, 32, what);
            p = (const float*)a.data();
            return;
        }
        thread_local std::vector<float> buf;
        buf.resize(a.size());
        widen_bf16((const uint16_t*)a.data(), buf.data(), buf.size());
        p = buf.data();
    }
};

std::vector<float>& act_out_buffer() {
    thread_local std::vector<float> buf;
    return buf;
}

// (an op with several bf16 outputs gives each but the first a buffer of its own)
struct ActOut {
    Array& a;
    float* p;
    ActOut(Array& out, const char* what, std::vector<float>& buf = act_out_buffer()) : a(out) {
        if (!is_bf16(out)) {
            check_dtype(out, dtype_code::Float, 32, what);
            p = (float*)out.data();
            return;
        }
        buf.resize(out.size());
        p = buf.data();
    }
    // after the op: round into a bf16 out (nothing to do for a float32 one)
    void finish() {
        if (p == (float*)a.data()) return;
        uint16_t* d = (uint16_t*)a.data();
        const size_t n = a.size();  // (ndarray::size() multiplies the shape out at every call)
        for (size_t i = 0; i < n; ++i) d[i] = moerun::bf16_bits(p[i]);
    }
};

// A [B, T, ...] activation with strides over B and T (contiguous within a token: checked by
// check_rows) as the DeltaNet op reads it: float32 where it lies, or bf16 (uint16) widened
// into buf as a packed [B, T, inner] array. -> (data, stride over B, stride over T).
struct RowsIn {
    const float* p;
    long s0, s1;
};

RowsIn rows_in(const Strided& t, std::vector<float>& buf, const char* what) {
    if (t.dtype() == nb::dtype<float>()) return {(const float*)t.data(), (long)t.stride(0), (long)t.stride(1)};
    MOERUN_CHECK(is_bf16(t), std::string(what) + ": wrong dtype");
    const size_t B = t.shape(0), T = t.shape(1);
    size_t inner = 1;
    for (size_t j = 2; j < t.ndim(); ++j) inner *= t.shape(j);
    buf.resize(B * T * inner);
    const uint16_t* src = (const uint16_t*)t.data();
    for (size_t b = 0; b < B; ++b)
        for (size_t i = 0; i < T; ++i)
            widen_bf16(src + b * t.stride(0) + i * t.stride(1), buf.data() + (b * T + i) * inner, inner);
    return {buf.data(), (long)(T * inner), (long)inner};
}

void check_shape(const Array& a, const std::vector<size_t>& shape, const char* what) {
    MOERUN_CHECK(a.ndim() == shape.size(), std::string(what) + ": wrong number of dimensions");
    size_t i = 0;
    for (size_t s : shape) {
        MOERUN_CHECK(a.shape(i) == s, std::string(what) + ": dimension " + std::to_string(i) + " is " +
                                          std::to_string(a.shape(i)) + ", expected " + std::to_string(s));
        ++i;
    }
}

// a [B, T, ...] tensor whose trailing dimensions are contiguous within each (row, token)
void check_rows(const Strided& a, std::initializer_list<size_t> shape, const char* what) {
    MOERUN_CHECK(a.ndim() == shape.size(), std::string(what) + ": wrong number of dimensions");
    size_t i = 0, inner = 1;
    for (size_t s : shape) {
        MOERUN_CHECK(a.shape(i) == s, std::string(what) + ": dimension " + std::to_string(i) + " is " +
                                          std::to_string(a.shape(i)) + ", expected " + std::to_string(s));
        ++i;
    }
    for (size_t j = a.ndim(); j-- > 2;) {
        MOERUN_CHECK(a.shape(j) <= 1 || a.stride(j) == (int64_t)inner,
                     std::string(what) + ": must be contiguous within a token");
        inner *= a.shape(j);
    }
    MOERUN_CHECK(a.stride(0) >= 0 && a.stride(1) >= 0, std::string(what) + ": negative strides");
}

// a packed format: int4 / int8 (4, 8) or one of llama.cpp's raw blocks (106 q5_0, 112 q4_k,
// 113 q5_k, 114 q6_k)
void check_fmt(int fmt) {
    MOERUN_CHECK(fmt == moerun::FMT_INT4 || fmt == moerun::FMT_INT8 || moerun::is_raw_fmt(fmt),
                 "fmt must be 4 or 8 (int4, int8) or 106, 112, 113, 114 (q5_0, q4_k, q5_k, q6_k); got " +
                     std::to_string(fmt));
}

// routed experts' code (moerun::expert_fmt): gate/up's format and down's, both packed or both float
void check_efmt(int efmt) {
    const int g = moerun::gate_fmt(efmt), d = moerun::down_fmt(efmt);
    MOERUN_CHECK(efmt >= 0 && efmt < (1 << 16), "experts' fmt out of range: " + std::to_string(efmt));
    MOERUN_CHECK(moerun::is_float_fmt(g) == moerun::is_float_fmt(d),
                 "experts: gate/up and down must be both packed or both float");
    if (moerun::is_float_fmt(g)) {
        MOERUN_CHECK(g == d, "float experts: one format for gate, up and down");
        return;
    }
    check_fmt(g);
    check_fmt(d);
}

// a raw format's rows are whole blocks: `in` a multiple of the block's inputs
void check_width(int fmt, size_t in, const char* what) {
    if (!moerun::is_raw_fmt(fmt)) return;
    const size_t be = (size_t)moerun::raw_block_elems(fmt);
    MOERUN_CHECK(in % be == 0, std::string(what) + ": an input width of " + std::to_string(in) +
                                   " is not a multiple of the format's block of " + std::to_string(be));
}

std::vector<size_t> with_last(std::vector<size_t> lead, size_t last) {
    lead.push_back(last);
    return lead;
}

// quantized weights: uint8 (int4 packed) or int8, lead + [bytes per row]
void check_qweight(const Array& w, int fmt, const std::vector<size_t>& lead, int nb, const char* what) {
    MOERUN_CHECK((w.dtype().code == (uint8_t)dtype_code::UInt || w.dtype().code == (uint8_t)dtype_code::Int) &&
                     w.dtype().bits == 8,
                 std::string(what) + ": must be uint8 or int8");
    check_shape(w, with_last(lead, moerun::row_bytes(fmt, nb)), what);
}

// their fp16 scales, lead + [blocks per row] (raw formats: lead + [0], their scales are in the rows)
void check_scales(const Array& s, int fmt, const std::vector<size_t>& lead, int nb, const char* what) {
    check_dtype(s, dtype_code::Float, 16, what);
    check_shape(s, with_last(lead, moerun::is_raw_fmt(fmt) ? 0 : nb), what);
}

// unquantized weights in fmt 32 (float32) or 16 (bf16, as uint16)
void check_float_weight(const Array& w, int fmt, const std::vector<size_t>& shape, const char* what) {
    MOERUN_CHECK(w.dtype() == (fmt == moerun::FMT_F32 ? nb::dtype<float>() : nb::dtype<uint16_t>()),
                 std::string(what) + ": must be float32 (fmt 32) or bf16 as uint16 (fmt 16)");
    check_shape(w, shape, what);
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
    nb::gil_scoped_release release;
    OpLock lk;
    moerun::qlinear(fmt, (int)M, (int)K, (int)N, (const float*)x.data(), (const uint8_t*)w.data(),
                    (const uint16_t*)scales.data(), (float*)out.data());
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
    ActIn xin(x, "x");
    ActOut o(out, "out");
    nb::gil_scoped_release release;
    OpLock lk;
    moerun::moe_experts(fmt, (int)T, (int)H, (int)I, (int)ex.size(), (int)K, xin.p, (const int64_t*)ids.data(),
                        (const float*)weights.data(), ex.data(), o.p);
    o.finish();
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
    ActIn xin(x, "x");
    ActOut o(out, "out");
    nb::gil_scoped_release release;
    OpLock lk;
    moerun::moe_experts(fmt, (int)T, (int)H, (int)I, (int)ex.size(), (int)K, xin.p, (const int64_t*)ids.data(),
                        (const float*)weights.data(), ex.data(), o.p);
    o.finish();
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
    nb::gil_scoped_release release;
    OpLock lk;
    moerun::attn_decode((int)Hq, (int)Hkv, (int)S, (int)D, (int)Dv, (const float*)q.data(), k.data(),
                        (long)k.stride(0), (long)k.stride(1), v.data(), (long)v.stride(0), (long)v.stride(1), scale,
                        (float*)out.data(), i8 ? moerun::KV_I8 : bf16 ? moerun::KV_BF16 : moerun::KV_F32, ks, st[0],
                        st[1], vs, st[2], st[3]);
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
    ActIn xin(x, "x");
    ActOut o(out, "out");
    nb::gil_scoped_release release;
    OpLock lk;
    moerun::rms_norm((int)M, (int)D, xin.p, (const float*)w.data(), w_offset, eps, o.p, (int)G);
    o.finish();
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
    nb::gil_scoped_release release;
    OpLock lk;
    const float* wp = w.shape(0) ? (const float*)w.data() : nullptr;
    moerun::norm_rope_heads((int)T, (int)H, (int)D, (const float*)x.data(), wp, w_offset, eps, (const float*)cos.data(),
                            (const float*)sin.data(), (int)rd, (float*)out.data());
}

// a weight of `rows` rows of `in` inputs: packed in fmt 4 / 8 with its scales, or float32
// (fmt 32) / bf16 as uint16 (fmt 16) [rows, in] with no scales (s is ignored)
moerun::QWeight qweight_of(const Array& w, const Array& s, int fmt, size_t rows, size_t in, const char* what) {
    if (moerun::is_float_fmt(fmt)) {
        check_float_weight(w, fmt, {rows, in}, what);
        return {fmt, (const uint8_t*)w.data(), nullptr};
    }
    check_fmt(fmt);
    check_width(fmt, in, what);
    const int nb = moerun::blocks_of((int)in);
    check_qweight(w, fmt, {rows}, nb, what);
    check_scales(s, fmt, {rows}, nb, what);
    return {fmt, (const uint8_t*)w.data(), (const uint16_t*)s.data()};
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
    ActIn xin(x, "x");
    ActOut o(out, "out");
    nb::gil_scoped_release release;
    OpLock lk;
    moerun::qlinear_multi((int)M, (int)K, (int)P, qw.data(), rows.data(), xin.p, o.p);
    o.finish();
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
    nb::gil_scoped_release release;
    OpLock lk;
    moerun::route_softmax_topk((int)T, (int)H, (int)E, (int)K, renorm, xin.p,
                               (const float*)router.data(), (int64_t*)ids.data(), (float*)weights.data());
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
    ActIn xin(x, "x");
    ActOut o(out, "out");
    nb::gil_scoped_release release;
    OpLock lk;
    moerun::swiglu_mlp((int)M, (int)H, (int)I, g, u, d, xin.p, o.p,
                       gate_vec.shape(0) ? (const float*)gate_vec.data() : nullptr);
    o.finish();
}

// Routed experts found pass by pass by a Python object (an expert store's,
// `experts.attach.StoreSource`): `fetch(ids, T)` with the pass's ids [T * K] int64 returns
// (needed: the distinct ids, gate, gate scales, up, up scales, down, down scales: one array per
// needed expert each, as `expert_table` takes them, the scales' lists empty for float experts);
// `release(ok)` hands them back once the pass has read them. Both run with the GIL taken again
// (the pass released it); the arrays are held until then.
struct PyExpertSource final : moerun::ExpertSource {
    nb::object obj, held;
    int fmt;
    size_t E, H, inter;
    std::vector<moerun::ExpertW> table;

    PyExpertSource(nb::object o, int fmt_, size_t E_, size_t H_, size_t I_)
        : obj(std::move(o)), fmt(fmt_), E(E_), H(H_), inter(I_), table(E_) {}
    ~PyExpertSource() override {
        nb::gil_scoped_acquire g;
        obj.reset();
        held.reset();
    }

    const moerun::ExpertW* fetch(int T, int K, const int64_t* ids) override {
        nb::gil_scoped_acquire g;
        const size_t n = (size_t)T * K;
        auto* copy = new int64_t[n];
        std::memcpy(copy, ids, n * sizeof(int64_t));
        nb::capsule owner(copy, [](void* p) noexcept { delete[] (int64_t*)p; });
        nb::object r = obj.attr("fetch")(nb::ndarray<nb::numpy, int64_t, nb::ndim<1>>(copy, {n}, owner), T);
        MOERUN_CHECK(nb::isinstance<nb::tuple>(r) && nb::len(r) == 7,
                     "expert source: fetch returns (needed, gate, gs, up, us, down, ds)");
        auto needed = nb::cast<std::vector<int64_t>>(r[0]);
        std::vector<Array> w[6];
        for (int j = 0; j < 6; ++j)
            for (nb::handle a : r[j + 1]) w[j].push_back(nb::cast<Array>(a, false));
        std::fill(table.begin(), table.end(), moerun::ExpertW{});
        if (!needed.empty()) {
            auto [ex, I] = expert_table(fmt, H, w[0], w[1], w[2], w[3], w[4], w[5]);
            MOERUN_CHECK(ex.size() == needed.size() && I == inter, "expert source: one expert's weights per needed id");
            for (size_t j = 0; j < needed.size(); ++j) {
                MOERUN_CHECK(needed[j] >= 0 && (size_t)needed[j] < E, "expert source: an id out of range");
                table[needed[j]] = ex[j];
            }
        }
        for (size_t i = 0; i < n; ++i)
            MOERUN_CHECK(table[ids[i]].gate != nullptr, "expert source: a routed expert was not given");
        held = std::move(r);
        return table.data();
    }

    void done(bool ok) override {
        nb::gil_scoped_acquire g;
        held.reset();
        if (ok) {
            obj.attr("release")(true);
            return;
        }
        try {  // the pass failed already: its error is the one to see
            obj.attr("release")(false);
        } catch (nb::python_error& e) {
            e.discard_as_unraisable("moerun expert source release");
        }
    }
};

// Watches a MoE half's routing for a Python callable (`layers.routes.RouteObservers`):
// obj(h [T, H] float32, ids [T, K] int64, weights [T, K] float32), fresh copies it may keep,
// called with the GIL taken again (the pass released it).
struct PyRouteObserver final : moerun::RouteObserver {
    nb::object obj;

    explicit PyRouteObserver(nb::object o) : obj(std::move(o)) {}
    ~PyRouteObserver() override {
        nb::gil_scoped_acquire g;
        obj.reset();
    }

    template <typename V>
    static nb::ndarray<nb::numpy, V, nb::ndim<2>> copy(const V* p, size_t rows, size_t cols) {
        auto* c = new V[rows * cols];
        std::memcpy(c, p, rows * cols * sizeof(V));
        nb::capsule owner(c, [](void* q) noexcept { delete[] (V*)q; });
        return nb::ndarray<nb::numpy, V, nb::ndim<2>>(c, {rows, cols}, owner);
    }

    void routed(int T, int H, int K, const float* h, const int64_t* ids, const float* w) override {
        nb::gil_scoped_acquire g;
        obj(copy(h, T, H), copy(ids, T, K), copy(w, T, K));
    }
};

// A MoE half's weights and settings for T tokens of H, checked (moe_block's norm_w ...
// shared_gate) into `a` (x, y and the observed outputs left null); `ex` and `sw` hold the
// experts' table and the shared expert's weights it points into, `src` the experts' source
// where they are found pass by pass.
struct MoeCall {
    moerun::MoeBlockArgs a{};
    std::vector<moerun::ExpertW> ex;
    std::unique_ptr<PyExpertSource> src;
    std::unique_ptr<PyRouteObserver> obs;
    std::vector<moerun::QWeight> sw;
    // h_out, ids_out, w_out (`observe`): a bf16 model's h and weights before their (exact) rounding
    std::optional<ActOut> ho, wo;
};

void moe_block_args(MoeCall& c, size_t T, size_t H, bool round_bf16, const Array& norm_w, float eps,
                    float norm_offset, const Array& router, int K, bool renorm, int efmt,
                    const std::vector<Array>& gate, const std::vector<Array>& gs, const std::vector<Array>& up,
                    const std::vector<Array>& us, const std::vector<Array>& down, const std::vector<Array>& ds,
                    const nb::object& source, const std::vector<Array>& shared, const std::vector<Array>& shared_s,
                    const std::vector<int>& shared_fmts, const Array& shared_gate,
                    const nb::object& observer = nb::none()) {
    check_dtype(norm_w, dtype_code::Float, 32, "norm_w");
    check_shape(norm_w, {H}, "norm_w");
    check_dtype(router, dtype_code::Float, 32, "router");
    MOERUN_CHECK(router.ndim() == 2 && router.shape(1) == H && router.shape(0) >= 1, "router must be [E, H]");
    const size_t E = router.shape(0);
    MOERUN_CHECK(K >= 1 && (size_t)K <= E, "K must be between 1 and the number of experts");
    std::vector<moerun::ExpertW> ex;
    size_t I;
    if (source.is_none()) {
        std::tie(ex, I) = expert_table(efmt, H, gate, gs, up, us, down, ds);
        MOERUN_CHECK(ex.size() == E, "experts: as many as the router's rows");
    } else {
        MOERUN_CHECK(gate.empty() && gs.empty() && up.empty() && us.empty() && down.empty() && ds.empty(),
                     "experts: weights or a source, not both");
        check_efmt(efmt);
        I = nb::cast<size_t>(source.attr("inter"));
        MOERUN_CHECK(I >= 1, "expert source: inter must be positive");
        c.src = std::make_unique<PyExpertSource>(source, efmt, E, H, I);
    }
    MOERUN_CHECK(shared.empty() || (shared.size() == 3 && shared_s.size() == 3 && shared_fmts.size() == 3),
                 "shared: none, or gate, up, down with their scales and fmts");
    size_t Is = 0;
    if (!shared.empty()) {
        MOERUN_CHECK(shared[0].ndim() == 2, "shared gate must be [Is, row]");
        Is = shared[0].shape(0);
        c.sw = {qweight_of(shared[0], shared_s[0], shared_fmts[0], Is, H, "shared gate"),
                qweight_of(shared[1], shared_s[1], shared_fmts[1], Is, H, "shared up"),
                qweight_of(shared[2], shared_s[2], shared_fmts[2], H, Is, "shared down")};
    }
    check_dtype(shared_gate, dtype_code::Float, 32, "shared_gate");
    MOERUN_CHECK(shared_gate.ndim() == 1 && (shared_gate.shape(0) == 0 || shared_gate.shape(0) == H),
                 "shared_gate must be [H] or empty");
    c.ex = std::move(ex);
    moerun::MoeBlockArgs& a = c.a;
    a.T = (int)T;
    a.H = (int)H;
    a.E = (int)E;
    a.K = K;
    a.I = (int)I;
    a.Is = (int)Is;
    a.renorm = renorm;
    a.round_bf16 = round_bf16;
    a.norm_w = (const float*)norm_w.data();
    a.norm_offset = norm_offset;
    a.eps = eps;
    a.router = (const float*)router.data();
    a.efmt = efmt;
    a.experts = c.src ? nullptr : c.ex.data();
    a.source = c.src.get();
    if (!c.sw.empty()) {
        a.sg = &c.sw[0];
        a.su = &c.sw[1];
        a.sd = &c.sw[2];
    }
    a.shared_gate = shared_gate.shape(0) ? (const float*)shared_gate.data() : nullptr;
    if (!observer.is_none()) {
        c.obs = std::make_unique<PyRouteObserver>(observer);
        a.observer = c.obs.get();
    }
}

// the outputs a MoE half fills for whoever watches its experts, when not empty: h_out [T, H]
// and w_out [T, K] in the model's dtype (bf16: round_bf16), ids_out [T, K] int64 (for their
// hooks); seen [E + 1] uint8, a route mask (an expert tracker's)
void moe_observe(MoeCall& c, Array& h_out, Array& ids_out, Array& w_out, Array& seen) {
    if (seen.size() > 0) {
        MOERUN_CHECK(seen.dtype() == nb::dtype<uint8_t>(), "seen: must be uint8");
        check_shape(seen, {(size_t)c.a.E + 1}, "seen");
        c.a.seen = (uint8_t*)seen.data();
    }
    const bool observed = h_out.size() > 0;
    MOERUN_CHECK(observed == (ids_out.size() > 0) && observed == (w_out.size() > 0),
                 "h_out, ids_out, w_out: all or none");
    if (!observed) return;
    const bool bf16 = c.a.round_bf16;
    const size_t T = c.a.T, K = c.a.K;
    MOERUN_CHECK(is_bf16(h_out) == bf16 && is_bf16(w_out) == bf16, "h_out, w_out: x's dtype");
    check_shape(h_out, {T, (size_t)c.a.H}, "h_out");
    check_dtype(ids_out, dtype_code::Int, 64, "ids_out");
    check_shape(ids_out, {T, K}, "ids_out");
    check_shape(w_out, {T, K}, "w_out");
    thread_local std::vector<float> hbuf, wbuf;
    c.ho.emplace(h_out, "h_out", hbuf);
    c.wo.emplace(w_out, "w_out", wbuf);
    c.a.h_out = c.ho->p;
    c.a.w_out = c.wo->p;
    c.a.ids_out = (int64_t*)ids_out.data();
}

void moe_observed_finish(MoeCall& c) {
    if (c.ho) c.ho->finish();
    if (c.wo) c.wo->finish();
}

// The MoE half of a decoder layer for a few tokens (moerun::moe_block_decode): out = x +
// experts(h) [+ shared expert(h)], h = RMSNorm(x). x [T, H] and out (float32, or both bf16:
// then every intermediate is rounded as the separate bf16 ops round it); norm_w [H] and
// router [E, H] float32; experts as `expert_table` takes them, in efmt; shared: [] or the
// shared expert's gate, up, down with their scales and fmts (as qlinear_multi's weights);
// shared_gate [H] float32 or empty. h_out [T, H] and w_out [T, K] in x's dtype and ids_out
// [T, K] int64 are filled when not empty (what the separate ops would hand their hooks).
void moe_block(Array x, Array norm_w, float eps, float norm_offset, Array router, int K, bool renorm, int efmt,
               std::vector<Array> gate, std::vector<Array> gs, std::vector<Array> up, std::vector<Array> us,
               std::vector<Array> down, std::vector<Array> ds, nb::object source, std::vector<Array> shared,
               std::vector<Array> shared_s, std::vector<int> shared_fmts, Array shared_gate, Array out, Array h_out,
               Array ids_out, Array w_out, Array seen, nb::object observer) {
    MOERUN_CHECK(x.ndim() == 2, "x must be [T, H]");
    const size_t T = x.shape(0), H = x.shape(1);
    MOERUN_CHECK(is_bf16(x) == is_bf16(out), "x and out: both float32 or both bf16");
    MoeCall c;
    moe_block_args(c, T, H, is_bf16(out), norm_w, eps, norm_offset, router, K, renorm, efmt, gate, gs, up, us, down, ds,
                   source, shared, shared_s, shared_fmts, shared_gate, observer);
    check_shape(out, {T, H}, "out");
    moe_observe(c, h_out, ids_out, w_out, seen);
    ActIn xin(x, "x");
    ActOut o(out, "out");
    c.a.x = xin.p;
    c.a.y = o.p;
    nb::gil_scoped_release release;
    OpLock lk;
    moerun::moe_block_decode(c.a);
    o.finish();
    moe_observed_finish(c);
}

// cos, sin [T, rd] float32 (rd 0: whatever cos has) for positions pos..pos+T-1 of a cache
// of L positions, checked -> rd
size_t check_rope_rows(const Array& cos, const Array& sin, size_t T, size_t rd, int pos, size_t L) {
    check_dtype(cos, dtype_code::Float, 32, "cos");
    check_dtype(sin, dtype_code::Float, 32, "sin");
    MOERUN_CHECK(cos.ndim() == 2 && sin.ndim() == 2 && cos.shape(0) == T && sin.shape(0) == T &&
                     cos.shape(1) == sin.shape(1) && (rd == 0 || cos.shape(1) == rd),
                 "cos, sin must be [T, rd]");
    MOERUN_CHECK(pos >= 0 && (size_t)pos + T <= L, "position outside the cache");
    return cos.shape(1);
}

// the positions of an attention block's cache slot (its c_sh: positions x head dim)
size_t cache_positions(const moerun::AttnBlockArgs& a) { return (size_t)(a.c_sh / a.D); }

// T tokens of H through a decoder layer's attention: q/k/v/o quantized [rows, bytes] + scales
// (q: Hq * D rows, 2 * Hq * D when gated); qn, kn [D] or empty; cos, sin [T, rd]; kc, vc
// [Hkv, max_len, D] (one slot of the cache: float32, or bf16 as uint16); token t sits at
// position pos + t. With in_norm [H] (float32) the call is the layer's first half (x + the
// block of the normed x; round_bf16 for a bf16 model's). The variants: qn [Hq * D] and kn
// [Hkv * D] (both, Hq > 1) are norms across all heads (OLMoE); qkv_bias [q_proj's rows + 2 * Hkv
// * D] float32 (Qwen2-MoE); window > 0 a sliding window. -> attn_block_decode's arguments.
moerun::AttnBlockArgs attn_block_args(size_t T, size_t H, Array qw, Array qs, int qf, Array kw, Array ks, int kf,
                                      Array vw, Array vs, int vf, Array ow, Array os, int of, Array qn, Array kn,
                                      float eps, Array cos, Array sin, Array kc, Array vc, int pos, int Hq, float scale,
                                      bool gated, const std::optional<Array>& in_norm, float in_offset, float in_eps,
                                      bool round_bf16, const std::optional<Array>& qkv_bias = std::nullopt,
                                      int window = 0) {
    const bool bf16 = is_bf16(kc);
    MOERUN_CHECK((bf16 || kc.dtype() == nb::dtype<float>()) && vc.dtype() == kc.dtype(),
                 "k, v cache: must be both float32 or both bf16 (as uint16)");
    MOERUN_CHECK(kc.ndim() == 3, "k cache must be [kv heads, max_len, D]");
    const size_t Hkv = kc.shape(0), L = kc.shape(1), D = kc.shape(2);
    check_shape(vc, {Hkv, L, D}, "v cache");
    MOERUN_CHECK(Hq > 0 && Hkv > 0 && Hq % Hkv == 0, "q heads must be a multiple of kv heads");
    moerun::AttnBlockArgs a{};
    a.q = qweight_of(qw, qs, qf, Hq * D * (gated ? 2 : 1), H, "q_proj");
    a.k = qweight_of(kw, ks, kf, Hkv * D, H, "k_proj");
    a.v = qweight_of(vw, vs, vf, Hkv * D, H, "v_proj");
    a.o = qweight_of(ow, os, of, H, Hq * D, "o_proj");
    // q/k norms across all heads (OLMoE): q's [Hq * D], k's [Hkv * D] (with one q head, per head is the same)
    const bool across = Hq > 1 && qn.ndim() == 1 && qn.shape(0) == (size_t)Hq * D;
    for (const Array* n : {&qn, &kn}) {
        check_dtype(*n, dtype_code::Float, 32, "q/k norm");
        const size_t want = !across ? D : n == &qn ? (size_t)Hq * D : Hkv * D;
        MOERUN_CHECK(n->ndim() == 1 && (n->shape(0) == 0 || n->shape(0) == want),
                     "q/k norm weight must be [D] (per head), [heads * D] for both (across heads) or empty");
    }
    MOERUN_CHECK(window >= 0, "window must be 0 (none) or a positive number of positions");
    if (qkv_bias) {
        check_dtype(*qkv_bias, dtype_code::Float, 32, "qkv_bias");
        check_shape(*qkv_bias, {Hq * D * (gated ? 2 : 1) + 2 * Hkv * D}, "qkv_bias (q_proj's, k_proj's, v_proj's rows)");
    }
    const size_t rd = check_rope_rows(cos, sin, T, 0, pos, L);
    MOERUN_CHECK(rd % 2 == 0 && rd <= D, "rotary dims must be even and at most the head dim");
    if (in_norm) {
        check_dtype(*in_norm, dtype_code::Float, 32, "in_norm");
        check_shape(*in_norm, {H}, "in_norm");
    }
    a.H = (int)H;
    a.Hq = Hq;
    a.Hkv = (int)Hkv;
    a.D = (int)D;
    a.qn = qn.shape(0) ? (const float*)qn.data() : nullptr;
    a.kn = kn.shape(0) ? (const float*)kn.data() : nullptr;
    a.eps = eps;
    a.cos = (const float*)cos.data();
    a.sin = (const float*)sin.data();
    a.rd = (int)rd;
    a.kc = kc.data();
    a.vc = vc.data();
    a.c_sh = (long)(L * D);
    a.pos = pos;
    a.scale = scale;
    a.kv_type = bf16 ? moerun::KV_BF16 : moerun::KV_F32;
    a.gated = gated;
    a.T = (int)T;
    a.has_half = in_norm.has_value();
    a.half = {in_norm ? (const float*)in_norm->data() : nullptr, in_offset, in_eps, round_bf16};
    a.qkv_bias = qkv_bias ? (const float*)qkv_bias->data() : nullptr;
    a.norm_across = across;
    a.window = window;
    return a;
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
    ActIn xin(x, "x");
    ActOut o(out, "out");
    nb::gil_scoped_release release;
    OpLock lk;
    moerun::attn_block_decode(a, xin.p, o.p);
    o.finish();
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
    ActIn xin(x, "x");
    ActOut o(out, "out");
    nb::gil_scoped_release release;
    OpLock lk;
    moerun::attn_block_decode(a, xin.p, o.p);
    o.finish();
}

// A one-layer MTP head's draft steps (moerun::mtp_step_decode) on one cache slot, its weights'
// arguments checked once: embed [Ve, H] (the token embedding, the model's dtype: float32, or
// bf16 as uint16); pre_w [2, H] float32: the two input norms' weights (offsets added); fc: H
// rows of 2H (weight, scales, fmt as qlinear_multi takes them); the attention half as
// attn_block_decode takes it (without x, out and position; in_norm required); the MoE half as
// moe_block takes it (without x and out, one token); the final norm (norm_w [H] float32,
// eps, offset); the head: V rows of H. Each `run` brings its tokens, hidden states, rope rows,
// position, the MoE half's observed outputs and h and logits.
class NativeMtp {
  public:
    // The head's weights, settings and cache slot, checked once (cos, sin: one row of rope,
    // for the checks; the calls bring their own)
    NativeMtp(Array embed, Array pre_w, float pre_eps, Array fcw, Array fcs, int fcf, Array qw, Array qs, int qf,
              Array kw, Array ks, int kf, Array vw, Array vs, int vf, Array ow, Array os, int of, Array qn, Array kn,
              float eps, Array cos, Array sin, Array kc, Array vc, int Hq, float scale, bool gated, Array in_norm,
              float in_offset, float in_eps, Array moe_norm_w, float moe_eps, float moe_norm_offset, Array router,
              int K, bool renorm, int efmt, std::vector<Array> gate, std::vector<Array> gs, std::vector<Array> up,
              std::vector<Array> us, std::vector<Array> down, std::vector<Array> ds,
              std::optional<nb::object> source, std::vector<Array> shared,
              std::vector<Array> shared_s, std::vector<int> shared_fmts, Array shared_gate, Array norm_w,
              float norm_eps, float norm_offset, Array hw, Array hs, int hf)
        : embed_(embed) {
        bf16_ = is_bf16(embed);
        MOERUN_CHECK(bf16_ || embed.dtype() == nb::dtype<float>(), "embed: must be float32 or bf16 (as uint16)");
        MOERUN_CHECK(embed.ndim() == 2, "embed must be [vocab, H]");
        H_ = embed.shape(1);
        check_dtype(pre_w, dtype_code::Float, 32, "pre_w");
        check_shape(pre_w, {2, H_}, "pre_w");
        MOERUN_CHECK(fcw.ndim() == 2, "fc must be [H, row]");
        a_.fc = qweight_of(fcw, fcs, fcf, H_, 2 * H_, "fc");
        a_.attn = attn_block_args(1, H_, qw, qs, qf, kw, ks, kf, vw, vs, vf, ow, os, of, qn, kn, eps, cos, sin, kc, vc, 0,
                                  Hq, scale, gated, in_norm, in_offset, in_eps, bf16_);
        moe_block_args(c_, 1, H_, bf16_, moe_norm_w, moe_eps, moe_norm_offset, router, K, renorm, efmt, gate, gs, up, us,
                       down, ds, source.value_or(nb::none()), shared, shared_s, shared_fmts, shared_gate);
        check_dtype(norm_w, dtype_code::Float, 32, "norm_w");
        check_shape(norm_w, {H_}, "norm_w");
        MOERUN_CHECK(hw.ndim() == 2, "head must be [V, row]");
        V_ = hw.shape(0);
        a_.head = qweight_of(hw, hs, hf, V_, H_, "head");
        a_.H = (int)H_;
        a_.V = (int)V_;
        a_.round_bf16 = bf16_;
        a_.pre_w = (const float*)pre_w.data();
        a_.pre_eps = pre_eps;
        a_.norm_w = (const float*)norm_w.data();
        a_.norm_offset = norm_offset;
        a_.norm_eps = norm_eps;
        keep_.insert(keep_.end(), {pre_w, fcw, fcs, qw, qs, kw, ks, vw, vs, ow, os, qn, kn, kc, vc, in_norm, moe_norm_w,
                                   router, shared_gate, norm_w, hw, hs});
        for (const auto* v : {&gate, &gs, &up, &us, &down, &ds, &shared, &shared_s}) keep_.insert(keep_.end(), v->begin(), v->end());
    }
    NativeMtp(const NativeMtp&) = delete;
    NativeMtp& operator=(const NativeMtp&) = delete;

    // tokens [T] int64 (each < the embedding's rows) and hidden [T, H] (the trunk's states,
    // the model's dtype) at positions pos..; cos, sin [T, rd]; the MoE half's observed outputs
    // and route mask as moe_block takes them; h [1, H] and logits [1, V] in the model's dtype.
    void run(Array tokens, Array hidden, Array cos, Array sin, int pos, Array h_out, Array ids_out, Array w_out,
             Array seen, Array h, Array logits) {
        for (const Array* t : {&h, &logits})
            MOERUN_CHECK(t->dtype() == embed_.dtype(), "embed, hidden, h, logits: all in the model's dtype");
        check_shape(h, {1, H_}, "h");
        check_shape(logits, {1, V_}, "logits");
        MoeCall c;  // this call's observed outputs and route mask on the head's MoE half
        c.a = c_.a;
        moe_observe(c, h_out, ids_out, w_out, seen);
        thread_local std::vector<float> u;
        moerun::MtpStepArgs a = prepare(tokens, hidden, cos, sin, pos, u);
        thread_local std::vector<float> hbuf;
        ActOut ho(h, "h", hbuf), lo(logits, "logits");
        a.moe = c.a;
        a.h = ho.p;
        a.logits = lo.p;
        {
            nb::gil_scoped_release release;
            OpLock lk;
            moerun::mtp_step_decode(a);
        }
        ho.finish();
        lo.finish();
        moe_observed_finish(c);
    }

  private:
    // `run`'s: the checks of tokens [T] (int64), hidden [T, H] (the model's
    // dtype), the rope rows and the position; per token its embedding row and hidden state
    // widened into u (float32, exact); -> the call's arguments but the MoE half's and the outputs.
    moerun::MtpStepArgs prepare(const Array& tokens, const Array& hidden, const Array& cos, const Array& sin, int pos,
                                std::vector<float>& u) const {
        MOERUN_CHECK(hidden.ndim() == 2 && hidden.shape(0) >= 1, "hidden must be [T, H]");
        const size_t T = hidden.shape(0), H = H_;
        MOERUN_CHECK(hidden.dtype() == embed_.dtype(), "embed, hidden, h, logits: all in the model's dtype");
        check_shape(hidden, {T, H}, "hidden");
        check_dtype(tokens, dtype_code::Int, 64, "tokens");
        check_shape(tokens, {T}, "tokens");
        const int64_t* tok = (const int64_t*)tokens.data();
        for (size_t t = 0; t < T; ++t) MOERUN_CHECK(tok[t] >= 0 && (size_t)tok[t] < embed_.shape(0),
                                                    "tokens: outside the embedding");
        check_rope_rows(cos, sin, T, a_.attn.rd, pos, cache_positions(a_.attn));
        u.resize(2 * T * H);
        for (size_t t = 0; t < T; ++t) {
            const size_t e = (size_t)tok[t] * H;
            float *ue = u.data() + 2 * t * H, *uh = ue + H;
            if (bf16_) {
                widen_bf16((const uint16_t*)embed_.data() + e, ue, H);
                widen_bf16((const uint16_t*)hidden.data() + t * H, uh, H);
            } else {
                std::memcpy(ue, (const float*)embed_.data() + e, H * 4);
                std::memcpy(uh, (const float*)hidden.data() + t * H, H * 4);
            }
        }
        moerun::MtpStepArgs a = a_;
        a.T = (int)T;
        a.attn.T = (int)T;
        a.attn.cos = (const float*)cos.data();
        a.attn.sin = (const float*)sin.data();
        a.attn.pos = pos;
        a.u = u.data();
        return a;
    }

    Array embed_;
    bool bf16_ = false;
    size_t H_ = 0, V_ = 0;
    moerun::MtpStepArgs a_{};
    MoeCall c_;  // the MoE half's weights (a_.moe is copied from it at each call)
    std::vector<Array> keep_;  // every array the arguments point into
};


// A Gated DeltaNet layer's weights and states for B rows of T tokens of C conv channels, all
// float32 and contiguous: conv_w [K, C] (the conv's weights transposed); conv [B, C, K-1]; A_log, dt_bias [Hv];
// S [B, Hv, Dk, Dv]; norm_w [Dv]; with conv_every [B, T, C, K-1] and S_every [B, T, Hv, Dk,
// Dv] (both or neither) every token's state goes there too. -> DeltaArgs with all but the
// activations (qkv, a, b, z, out) filled.
moerun::DeltaArgs delta_args(size_t B, size_t T, size_t C, const Array& conv_w, const Array& conv,
                             const std::optional<Array>& conv_every, const Array& A_log, const Array& dt_bias,
                             const Array& S, const std::optional<Array>& S_every, const Array& norm_w, float eps, int Hk) {
    for (const Array* t : {&conv_w, &conv, &A_log, &dt_bias, &S, &norm_w})
        check_dtype(*t, dtype_code::Float, 32, "deltanet tensors");
    MOERUN_CHECK(conv_every.has_value() == S_every.has_value(), "conv_every and S_every go together");
    MOERUN_CHECK(conv_w.ndim() == 2 && conv_w.shape(1) == C && conv_w.shape(0) >= 2, "conv_w must be [K, C], K >= 2");
    const size_t K = conv_w.shape(0);
    check_shape(conv, {B, C, K - 1}, "conv");
    MOERUN_CHECK(S.ndim() == 4 && S.shape(0) == B, "S must be [B, Hv, Dk, Dv]");
    const size_t Hv = S.shape(1), Dk = S.shape(2), Dv = S.shape(3);
    MOERUN_CHECK(Hk > 0 && Hv % (size_t)Hk == 0, "value heads must be a multiple of key heads");
    MOERUN_CHECK(C == 2 * (size_t)Hk * Dk + Hv * Dv, "qkv: C must be 2 * Hk * Dk + Hv * Dv");
    check_shape(A_log, {Hv}, "A_log");
    check_shape(dt_bias, {Hv}, "dt_bias");
    check_shape(norm_w, {Dv}, "norm_w");
    if (S_every) {
        check_dtype(*conv_every, dtype_code::Float, 32, "conv_every");
        check_dtype(*S_every, dtype_code::Float, 32, "S_every");
        check_shape(*conv_every, {B, T, C, K - 1}, "conv_every");
        check_shape(*S_every, {B, T, Hv, Dk, Dv}, "S_every");
    }
    moerun::DeltaArgs d{};
    d.B = (int)B;
    d.T = (int)T;
    d.C = (int)C;
    d.K = (int)K;
    d.Hk = Hk;
    d.Hv = (int)Hv;
    d.Dk = (int)Dk;
    d.Dv = (int)Dv;
    d.conv_w = (const float*)conv_w.data();
    d.conv = (float*)conv.data();
    d.conv_every = conv_every ? (float*)conv_every->data() : nullptr;
    d.A_log = (const float*)A_log.data();
    d.dt_bias = (const float*)dt_bias.data();
    d.S = (float*)S.data();
    d.S_every = S_every ? (float*)S_every->data() : nullptr;
    d.norm_w = (const float*)norm_w.data();
    d.eps = eps;
    return d;
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
    ActOut o(out, "out");
    auto take = [](const RowsIn& r, const float*& p, long& sb, long& st) { p = r.p, sb = r.s0, st = r.s1; };
    take(xq, d.qkv, d.qkv_sb, d.qkv_st);
    take(xa, d.a, d.a_sb, d.a_st);
    take(xb, d.b, d.b_sb, d.b_st);
    take(xz, d.z, d.z_sb, d.z_st);
    d.out = o.p;
    nb::gil_scoped_release release;
    OpLock lk;
    moerun::deltanet_decode(d);
    o.finish();
}

// The linear-attention half of a Qwen3.5 decoder layer (moerun::deltanet_block_decode):
// out = x + out_proj(DeltaNet(projections of RMSNorm(x))). x, out [B, T, H], both float32 or
// both bf16; norm_w [H] float32; proj: in_proj_qkv, in_proj_z, in_proj_a, in_proj_b (weights,
// scales, fmts as qlinear_multi takes them; rows C, Hv * Dv, Hv, Hv); out_proj [H rows of
// Hv * Dv]; the DeltaNet's weights and states as `delta_args` takes them.
// The linear-attention half's weights, settings and states for B rows of T tokens of H,
// checked -> deltanet_block_decode's arguments (x and y left null).
moerun::DeltaBlockArgs deltanet_block_args(size_t B, size_t T, size_t H, bool round_bf16, const Array& norm_w,
                                           float norm_offset, float norm_eps, const std::vector<Array>& proj,
                                           const std::vector<Array>& proj_s, const std::vector<int>& proj_fmts,
                                           const Array& ow, const Array& os, int of, const Array& conv_w,
                                           const Array& conv, const std::optional<Array>& conv_every,
                                           const Array& A_log, const Array& dt_bias, const Array& S,
                                           const std::optional<Array>& S_every, const Array& gnorm_w, float eps,
                                           int Hk) {
    check_dtype(norm_w, dtype_code::Float, 32, "norm_w");
    check_shape(norm_w, {H}, "norm_w");
    MOERUN_CHECK(proj.size() == 4 && proj_s.size() == 4 && proj_fmts.size() == 4,
                 "proj: in_proj_qkv, in_proj_z, in_proj_a, in_proj_b with their scales and fmts");
    MOERUN_CHECK(proj[0].ndim() == 2, "in_proj_qkv must be [C, row]");
    const size_t C = proj[0].shape(0);
    moerun::DeltaBlockArgs a{};
    a.d = delta_args(B, T, C, conv_w, conv, conv_every, A_log, dt_bias, S, S_every, gnorm_w, eps, Hk);
    const size_t Hv = a.d.Hv, Z = Hv * a.d.Dv;
    const size_t rows[4] = {C, Z, Hv, Hv};
    const char* names[4] = {"in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b"};
    for (int p = 0; p < 4; ++p) a.proj[p] = qweight_of(proj[p], proj_s[p], proj_fmts[p], rows[p], H, names[p]);
    a.out_proj = qweight_of(ow, os, of, H, Z, "out_proj");
    a.H = (int)H;
    a.norm_w = (const float*)norm_w.data();
    a.norm_offset = norm_offset;
    a.norm_eps = norm_eps;
    a.round_bf16 = round_bf16;
    return a;
}

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
    ActIn xin(x, "x");
    ActOut o(out, "out");
    a.x = xin.p;
    a.y = o.p;
    nb::gil_scoped_release release;
    OpLock lk;
    moerun::deltanet_block_decode(a);
    o.finish();
}

// A run's layer stack for one pass shape (moerun.layers.stack): B rows of T tokens (a
// decode step, or a speculative verification pass). Each layer's two halves with their weights,
// settings, whole KV cache and states checked once (what attn_block_decode, deltanet_block
// and moe_block check at every call), then each pass one call: x [B, T, H] through every
// layer, the halves taking turns writing a and b (each half as its own op computes it: the
// same bits). Each pass names its rows' cache slots and positions: row b's keys, values and
// DeltaNet states are those at slot slots[b], its tokens at positions pos[b], pos[b] + 1, ...
// A batch row's attention is attn_block_rows's (each token a row of its own, at its row's
// slot and its position), its DeltaNet
// state read and written at its slot in place, its MoE tokens computed each on its own: a
// row's bits are those it gets alone. A decode pass of the demo model made 16 such calls,
// each converting its dozen or more arrays again.
class NativeStack {
  public:
    NativeStack(size_t B, size_t T, size_t H, bool bf16) : B_(B), T_(T), H_(H), bf16_(bf16) {
        MOERUN_CHECK(B >= 1 && T >= 1, "a stack runs B >= 1 rows of T >= 1 tokens");
    }
    NativeStack(const NativeStack&) = delete;
    NativeStack& operator=(const NativeStack&) = delete;

    void add_attention(Array qw, Array qs, int qf, Array kw, Array ks, int kf, Array vw, Array vs, int vf, Array ow,
                       Array os, int of, Array qn, Array kn, float eps, Array cos, Array sin, Array kc, Array vc,
                       int pos, int Hq, float scale, bool gated, Array in_norm, float in_offset, float in_eps,
                       std::optional<Array> qkv_bias, int window) {
        // kc, vc: the layer's whole cache [slots, kv heads, max_len, D]; the arguments as for slot 0
        MOERUN_CHECK(kc.ndim() == 4, "k cache must be [slots, kv heads, max_len, D]");
        const size_t S = kc.shape(0), Hkv = kc.shape(1), L = kc.shape(2), D = kc.shape(3);
        check_shape(vc, {S, Hkv, L, D}, "v cache");
        const size_t slot_shape[3] = {Hkv, L, D};
        Array k0(kc.data(), 3, slot_shape, nb::handle(), nullptr, kc.dtype()),
            v0(vc.data(), 3, slot_shape, nb::handle(), nullptr, vc.dtype());  // (views for the call: kc, vc own them)
        // a batch's arguments are checked as one token's (each pass checks its rows' positions)
        MOERUN_CHECK(cos.ndim() == 2 && sin.ndim() == 2 && cos.shape(0) >= 1, "cos, sin must be [T, rd]");
        const size_t TA = B_ > 1 ? 1 : T_, cs[2] = {TA, cos.shape(1)}, ss[2] = {TA, sin.shape(1)};
        Array c1(cos.data(), 2, cs, nb::handle(), nullptr, cos.dtype()), s1(sin.data(), 2, ss, nb::handle(), nullptr, sin.dtype());
        Layer l;
        l.attn = true;
        l.at = attn_block_args(TA, H_, qw, qs, qf, kw, ks, kf, vw, vs, vf, ow, os, of, qn, kn, eps, c1, s1, k0, v0,
                               B_ > 1 ? 0 : pos, Hq, scale, gated, in_norm, in_offset, in_eps, bf16_, qkv_bias, window);
        l.at.T = (int)(B_ * T_);
        l.slots = S;
        l.slot_bytes = Hkv * L * D * (is_bf16(kc) ? 2 : 4);
        keep_.insert(keep_.end(), {qw, qs, kw, ks, vw, vs, ow, os, qn, kn, kc, vc, in_norm});
        if (qkv_bias) keep_.push_back(*qkv_bias);
        layers_.push_back(std::move(l));
    }

    void add_deltanet(Array norm_w, float norm_offset, float norm_eps, std::vector<Array> proj,
                      std::vector<Array> proj_s, std::vector<int> proj_fmts, Array ow, Array os, int of, Array conv_w,
                      Array conv, Array A_log, Array dt_bias, Array S, Array gnorm_w, float eps, int Hk) {
        // conv [slots, C, K - 1], S [slots, Hv, Dk, Dv]: the layer's whole states
        Layer l;
        l.dn = deltanet_block_args(conv.ndim() ? conv.shape(0) : 0, T_, H_, bf16_, norm_w, norm_offset, norm_eps, proj,
                                   proj_s, proj_fmts, ow, os, of, conv_w, conv, std::nullopt, A_log, dt_bias, S,
                                   std::nullopt, gnorm_w, eps, Hk);
        l.slots = conv.shape(0);
        keep_.insert(keep_.end(), {norm_w, ow, os, conv_w, conv, A_log, dt_bias, S, gnorm_w});
        keep_.insert(keep_.end(), proj.begin(), proj.end());
        keep_.insert(keep_.end(), proj_s.begin(), proj_s.end());
        deltanets_++;
        layers_.push_back(std::move(l));
    }

    void add_moe(Array norm_w, float eps, float norm_offset, Array router, int K, bool renorm, int efmt,
                 std::vector<Array> gate, std::vector<Array> gs, std::vector<Array> up, std::vector<Array> us,
                 std::vector<Array> down, std::vector<Array> ds, std::optional<nb::object> source,
                 std::vector<Array> shared, std::vector<Array> shared_s, std::vector<int> shared_fmts,
                 Array shared_gate, std::optional<nb::object> observer) {
        MOERUN_CHECK(!layers_.empty() && !layers_.back().moe, "a MoE half follows an attention or DeltaNet half");
        auto c = std::make_unique<MoeCall>();
        moe_block_args(*c, B_ * T_, H_, bf16_, norm_w, eps, norm_offset, router, K, renorm, efmt, gate, gs, up, us, down, ds,
                       source.value_or(nb::none()), shared, shared_s, shared_fmts, shared_gate,
                       observer.value_or(nb::none()));
        keep_.insert(keep_.end(), {norm_w, router, shared_gate});
        for (const auto* v : {&gate, &gs, &up, &us, &down, &ds, &shared, &shared_s}) keep_.insert(keep_.end(), v->begin(), v->end());
        layers_.back().moe = std::move(c);
    }

    // x, a, b [B, T, H] in the stack's dtype; cos, sin [B * T, rd]: the pass's rope rows;
    // slots, pos int64 [B]: each row's cache slot and first position. conv_every, S_every: one
    // each per DeltaNet layer (every token's states, kept for a rollback; T > 1) or none (in
    // place); seen: per layer its experts' route mask [E + 1] uint8 or empty, or none at all
    // (no layer has one).
    void run(Array x, Array a, Array b, Array cos, Array sin, Array slots, Array pos, std::vector<Array> conv_every,
             std::vector<Array> S_every, std::vector<Array> seen) {
        check_states(conv_every, S_every, seen);
        for (const Array* t : {&x, &a, &b}) {
            if (bf16_)
                MOERUN_CHECK(is_bf16(*t), "x, a, b: the stack's dtype (bf16, as uint16)");
            else
                check_dtype(*t, dtype_code::Float, 32, "x, a, b");
            check_shape(*t, {B_, T_, H_}, "x, a, b");
        }
        for (const Array* r : {&slots, &pos}) {
            check_dtype(*r, dtype_code::Int, 64, "slots, pos");
            check_shape(*r, {B_}, "slots, pos");
        }
        const int64_t* sl = (const int64_t*)slots.data();
        const int64_t* ps = (const int64_t*)pos.data();
        thread_local std::vector<long> row_off;
        thread_local std::vector<int> row_pos;
        row_off.assign(B_ * T_, 0);
        row_pos.assign(B_ * T_, 0);
        // this pass's arguments, checked, into copies of each layer's (the stack is not changed:
        // another thread's pass on it would see none of this one's)
        thread_local std::vector<Layer> pass;
        pass.resize(layers_.size());
        size_t j = 0;
        for (size_t i = 0; i < layers_.size(); ++i) {
            const Layer& l = layers_[i];
            Layer& c = pass[i];
            MOERUN_CHECK(l.moe != nullptr, "every layer needs its MoE half");
            c.attn = l.attn;
            for (size_t r = 0; r < B_; ++r)
                MOERUN_CHECK(sl[r] >= 0 && (size_t)sl[r] < l.slots, "a slot outside the cache");
            if (l.attn) {
                c.at = l.at;
                const size_t L = cache_positions(l.at);
                c.at.cos = (const float*)cos.data();
                c.at.sin = (const float*)sin.data();
                if (B_ == 1) {  // one row's T tokens at pos, pos + 1, ... of its slot
                    MOERUN_CHECK(ps[0] >= 0 && ps[0] <= (int64_t)L, "position outside the cache");
                    check_rope_rows(cos, sin, T_, l.at.rd, (int)ps[0], L);
                    c.at.pos = (int)ps[0];
                    c.at.kc = (char*)l.at.kc + sl[0] * l.slot_bytes;
                    c.at.vc = (char*)l.at.vc + sl[0] * l.slot_bytes;
                } else {  // each token a row of its own, at its row's slot and its position
                    check_rope_rows(cos, sin, B_ * T_, l.at.rd, 0, L);
                    for (size_t r = 0; r < B_; ++r) {
                        MOERUN_CHECK(ps[r] >= 0 && (size_t)ps[r] + T_ <= L, "position outside the cache");
                        for (size_t t = 0; t < T_; ++t) {
                            row_off[r * T_ + t] =
                                (long)(sl[r] * (int64_t)(l.slot_bytes / (l.at.kv_type == moerun::KV_BF16 ? 2 : 4)));
                            row_pos[r * T_ + t] = (int)(ps[r] + t);
                        }
                    }
                    c.at.row_off = row_off.data();
                    c.at.row_pos = row_pos.data();
                }
            } else {
                c.dn = l.dn;
                moerun::DeltaArgs& d = c.dn.d;
                d.B = (int)B_;
                d.row_slot = sl;
                d.conv_every = conv_every.empty() ? nullptr : (float*)conv_every[j].data();
                d.S_every = S_every.empty() ? nullptr : (float*)S_every[j].data();
                ++j;
            }
            c.moe_args = l.moe->a;
            c.moe_args.T = (int)(B_ * T_);
            c.moe_args.seen = seen.empty() || seen[i].size() == 0 ? nullptr : (uint8_t*)seen[i].data();
        }
        nb::gil_scoped_release release;
        OpLock lk;
        const Array* cur = &x;
        for (Layer& l : pass) {
            {
                ActIn xin(*cur, "x");
                ActOut o(a, "out");
                if (l.attn) {
                    moerun::attn_block_decode(l.at, xin.p, o.p);
                } else {
                    l.dn.x = xin.p;
                    l.dn.y = o.p;
                    moerun::deltanet_block_decode(l.dn);
                }
                o.finish();
            }
            ActIn xin(a, "x");
            ActOut o(b, "out");
            l.moe_args.x = xin.p;
            l.moe_args.y = o.p;
            moerun::moe_block_decode(l.moe_args);
            o.finish();
            cur = &b;
        }
    }

  private:
    // `run`'s kept-state buffers and route masks, checked against the layers
    void check_states(const std::vector<Array>& conv_every, const std::vector<Array>& S_every,
                      const std::vector<Array>& seen) const {
        MOERUN_CHECK(conv_every.size() == S_every.size() && (conv_every.empty() || conv_every.size() == deltanets_),
                     "conv_every, S_every: one each per DeltaNet layer, or none");
        MOERUN_CHECK(seen.empty() || seen.size() == layers_.size(), "seen: one per layer, or none");
        size_t j = 0;
        for (size_t i = 0; i < layers_.size(); ++i) {
            const Layer& l = layers_[i];
            if (!l.attn && !conv_every.empty()) {
                const moerun::DeltaArgs& d = l.dn.d;
                check_dtype(conv_every[j], dtype_code::Float, 32, "conv_every");
                check_dtype(S_every[j], dtype_code::Float, 32, "S_every");
                check_shape(conv_every[j], {B_, T_, (size_t)d.C, (size_t)d.K - 1}, "conv_every");
                check_shape(S_every[j], {B_, T_, (size_t)d.Hv, (size_t)d.Dk, (size_t)d.Dv}, "S_every");
            }
            j += !l.attn;
            if (!seen.empty() && seen[i].size() > 0) {
                MOERUN_CHECK(l.moe != nullptr, "every layer needs its MoE half");
                MOERUN_CHECK(seen[i].dtype() == nb::dtype<uint8_t>(), "seen: must be uint8");
                check_shape(seen[i], {(size_t)l.moe->a.E + 1}, "seen");
            }
        }
    }

    struct Layer {
        bool attn = false;
        size_t slots = 0;       // the cache's slots (a pass's rows must name one of them)
        size_t slot_bytes = 0;  // an attention layer's: one slot of its k (or v) cache
        moerun::AttnBlockArgs at{};
        moerun::DeltaBlockArgs dn{};
        std::unique_ptr<MoeCall> moe;  // the MoE half's weights (its arguments point into them)
        moerun::MoeBlockArgs moe_args{};  // a pass's copy of moe->a, with its x, y and route mask
    };
    size_t B_, T_, H_;
    bool bf16_;
    size_t deltanets_ = 0;
    std::vector<Layer> layers_;
    std::vector<Array> keep_;  // every array the layers point into, alive as long as the stack
};

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
    nb::gil_scoped_release release;
    OpLock lk;
    moerun::set_threads(n);
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
    m.def("moe_block", &moe_block, nb::arg("x"), nb::arg("norm_w"), nb::arg("eps"), nb::arg("norm_offset"),
          nb::arg("router"), nb::arg("k"), nb::arg("renorm"), nb::arg("efmt"), nb::arg("gate"), nb::arg("gate_scales"),
          nb::arg("up"), nb::arg("up_scales"), nb::arg("down"), nb::arg("down_scales"),
          nb::arg("source").none(), nb::arg("shared"), nb::arg("shared_scales"), nb::arg("shared_fmts"), nb::arg("shared_gate"), nb::arg("out"), nb::arg("h_out"),
          nb::arg("ids_out"), nb::arg("w_out"), nb::arg("seen"), nb::arg("observer").none() = nb::none(),
          "the MoE half of a decoder layer for a few tokens: out = x + experts(h) [+ shared expert(h)], h = RMSNorm(x), "
          "softmax top-k routing; observer(h, ids, weights) is called once the router has picked");
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
        .def("add_deltanet", &NativeStack::add_deltanet)
        .def("add_moe", &NativeStack::add_moe, nb::arg("norm_w"), nb::arg("eps"), nb::arg("norm_offset"),
             nb::arg("router"), nb::arg("k"), nb::arg("renorm"), nb::arg("efmt"), nb::arg("gate"), nb::arg("gate_scales"),
             nb::arg("up"), nb::arg("up_scales"), nb::arg("down"), nb::arg("down_scales"), nb::arg("source").none(),
             nb::arg("shared"), nb::arg("shared_scales"), nb::arg("shared_fmts"), nb::arg("shared_gate"),
             nb::arg("observer").none() = nb::none())
        .def("run", &NativeStack::run, nb::arg("x"), nb::arg("a"), nb::arg("b"), nb::arg("cos"), nb::arg("sin"),
             nb::arg("slots"), nb::arg("pos"), nb::arg("conv_every"), nb::arg("S_every"), nb::arg("seen"));
    nb::class_<NativeMtp>(m, "NativeMtp", "a one-layer MTP head's calls on one cache slot: its arguments checked once")
        .def(nb::init<Array, Array, float, Array, Array, int, Array, Array, int, Array, Array, int, Array, Array, int,
                      Array, Array, int, Array, Array, float, Array, Array, Array, Array, int, float, bool, Array, float,
                      float, Array, float, float, Array, int, bool, int, std::vector<Array>, std::vector<Array>,
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
