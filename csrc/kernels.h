// Quantized CPU kernels: the block formats, the per-ISA microkernel table and the drivers.
//
// Formats (moerun/quant/formats.py is the reference and the packer):
//   every weight row is cut into blocks of QK = 32 inputs (the input dimension padded with
//   zeros to a multiple of 32); each block has one fp16 scale d.
//   int4: 16 bytes per block; byte j holds element j in its low nibble and element j + 16 in
//         its high nibble, stored as q + 8 (q in [-8, 7]); w = d * q.
//   int8: 32 signed bytes per block, q in [-127, 127]; w = d * q.
// That is each block's natural layout. Each whole group of 8 blocks of a row is stored with
// its 4-byte words interleaved: word k of block j of the group at word k * 8 + j. The last
// nb % 8 blocks of a row stay natural. (Format version 2; the scales are not interleaved.)
// Raw formats (llama.cpp's, executed in their own blocks; moerun/kernels/ggml.py is the
// reference): Q4_K / Q5_K super-blocks of 256 cut in 8 sub-blocks of 32 with 6-bit scale sc
// and min m (w = d * sc * q - dmin * m, q unsigned 4 / 5 bits), Q6_K 16 sub-blocks of 16 with
// int8 scales (w = d * sc * (q - 32), q 6 bits), Q5_0 blocks of 32 (w = d * (q - 16)). Their
// gemm takes unsigned q against the int8 activations and applies the offsets through
// per-block activation sums (xs; Q6_K: sums over 16, computed per call).
// Activations are quantized to int8 once per row in the same blocks of 32 (d = absmax / 127)
// so each block's dot product is an integer dot product scaled by d_w * d_x. Each kernel
// table's quantize_row lays them out as its gemm reads them (x86: interleaved like the
// weights; generic: natural).
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace moerun {

constexpr int QK = 32;
// bytes of weights the x86 GEMMs prefetch ahead of the row they compute (kernels_x86.inc)
constexpr int kPrefetchBytes = 4096;
// FMT_BF16 / FMT_F32: unquantized weights (rows of `in` bf16 or float32 values), run against
// float32 activations as they are (no blocks, no scales)
// FMT_Q5_0 .. FMT_Q6_K: llama.cpp's raw blocks (100 + the GGML type id), each weight row its
// GGUF blocks byte for byte as in the file, no separate scales (see "Raw formats" below).
enum Fmt : int {
    FMT_INT4 = 4, FMT_INT8 = 8, FMT_BF16 = 16, FMT_F32 = 32,
    FMT_Q5_0 = 106, FMT_Q4_K = 112, FMT_Q5_K = 113, FMT_Q6_K = 114
};

inline bool is_float_fmt(int fmt) { return fmt == FMT_BF16 || fmt == FMT_F32; }
inline bool is_raw_fmt(int fmt) { return fmt == FMT_Q5_0 || fmt == FMT_Q4_K || fmt == FMT_Q5_K || fmt == FMT_Q6_K; }
// Raw formats: inputs and bytes per GGUF block (Q5_0: 32 / 22; the K-quants' super-blocks of
// 256: Q4_K 144, Q5_K 176, Q6_K 210). A row's width must be a whole number of blocks.
inline int raw_block_elems(int fmt) { return fmt == FMT_Q5_0 ? 32 : 256; }
inline int raw_block_bytes(int fmt) {
    return fmt == FMT_Q5_0 ? 22 : fmt == FMT_Q4_K ? 144 : fmt == FMT_Q5_K ? 176 : 210;
}
inline int blocks_of(int n) { return (n + QK - 1) / QK; }
// bytes of a packed row of nb activation blocks of 32 (raw formats: nb * 32 a whole number of
// their blocks)
inline size_t row_bytes(int fmt, int nb) {
    if (is_raw_fmt(fmt)) return (size_t)nb * QK / raw_block_elems(fmt) * raw_block_bytes(fmt);
    return (size_t)nb * (fmt == FMT_INT4 ? QK / 2 : QK);
}
// Routed experts' format code: gate and up in the low byte, down in the next (0: the same),
// so that one int still names the experts' formats where a single code did before.
inline int gate_fmt(int efmt) { return efmt & 0xff; }
inline int down_fmt(int efmt) { return (efmt >> 8) ? (efmt >> 8) : (efmt & 0xff); }
inline int expert_fmt(int gate, int down) { return gate == down ? gate : gate | (down << 8); }
// bytes of one weight row of `in` inputs in any format
inline size_t weight_row_bytes(int fmt, int in) {
    return fmt == FMT_F32 ? (size_t)in * 4 : fmt == FMT_BF16 ? (size_t)in * 2 : row_bytes(fmt, blocks_of(in));
}

// One GEMM tile: y[i * y_row + r] = W[r] . X[xidx ? xidx[i] : i] for r < nrows, i < ntok.
struct GemmArgs {
    int nrows, nb;
    const uint8_t* w;     // row r starts at w + r * w_row
    size_t w_row;         // bytes per weight row
    const uint16_t* ws;   // fp16 scales, row r at ws + r * nb
    int ntok;
    const int8_t* xq;     // activation row j: xq + j * nb * QK
    const float* xd;      // its block scales: xd + j * nb
    const float* xs;      // xd[b] * sum of the block's q (the int4 offset correction)
    const int32_t* xidx;  // token i reads activation row xidx[i] (nullptr: row i)
    float* y;
    size_t y_row;
    // float formats only: the input width and float32 activation row j at xf + j * x_row
    int in = 0;
    const float* xf = nullptr;
    size_t x_row = 0;
};

// One kv head's attention over one chunk of n cached positions, for its G query heads (one
// query token each): scores p[g, s] = scale * q_g . k_s, then per query head the chunk's
// max m[g], sum of exp l[g] and unnormalised output o[g] = sum_s exp(p[g, s] - m[g]) v_s.
// The driver merges chunks (and kv heads) with the usual log-sum-exp rescaling.
// Keys and values are float32, bf16, or int8 with one float scale per position (an int8 KV
// cache: x = q * scale), read (and scaled) on the fly.
enum KvType : int { KV_F32 = 0, KV_BF16 = 1, KV_I8 = 2 };
struct AttnArgs {
    int kv_type;          // KvType
    int G, D, Dv, n;
    const float* q;       // [G, D] contiguous
    const void* k;        // position s's key at k + s * k_ss elements (contiguous D values)
    long k_ss;
    const void* v;        // position s's value at v + s * v_ss
    long v_ss;
    const float* k_scale; // KV_I8 only: position s's scale at k_scale[s * ks_ss]
    long ks_ss;
    const float* v_scale;
    long vs_ss;
    float scale;
    float* p;             // scratch [G, n]
    float* m;             // [G]
    float* l;             // [G]
    float* o;             // [G, Dv]
};

// One (row, value head) of Gated DeltaNet over T tokens (moerun/layers/deltanet.py is the
// reference): per token, with the state S_t-1 ([Dk, Dv], row-major), kS = k S, qS = q S,
// delta = (v - decay * kS) * beta, o = decay * qS + (q . k) delta,
// S_t = decay * S_t-1 + k^T delta, then o <- RMSNorm(o) * norm_w * silu(z).
struct DeltaHeadArgs {
    int T, Dk, Dv;
    const float *q, *k, *v;      // token t's at + t * x_st (q and k already L2-normalised, q scaled)
    long x_st;
    const float *decay, *beta;   // [T]
    const float* S;              // the state before the first token
    float* S_out;                // token t's state at S_out + t * s_st; s_st 0 and S_out == S: in place
    long s_st;
    const float* z;              // token t's output gate at z + t * z_st
    long z_st;
    const float* norm_w;         // [Dv]
    float eps;
    float* o;                    // token t's output at o + t * o_st
    long o_st;
    float* scratch;              // 2 * Dv floats
};

struct KernelTable {
    const char* name;
    // Quantize n floats (padded with zeros to nb * QK) into q, d, s (s[b] = d[b] * sum q).
    void (*quantize_row)(const float* x, int n, int nb, int8_t* q, float* d, float* s);
    void (*gemm_q4)(const GemmArgs& a);
    void (*gemm_q8)(const GemmArgs& a);
    void (*attn_chunk)(const AttnArgs& a);
    void (*delta_head)(const DeltaHeadArgs& a);
    // float32 / bf16 weight rows against float32 activations (GemmArgs' float fields): each
    // (row, token) dot product in one fixed order, whatever the number of tokens in the call
    void (*gemm_f32)(const GemmArgs& a);
    void (*gemm_bf16)(const GemmArgs& a);
    // raw-format weight rows (fmt one of FMT_Q5_0 .. FMT_Q6_K; a.ws unused) against the int8
    // activations as quantize_row laid them out
    void (*gemm_raw)(int fmt, const GemmArgs& a);
};

extern const KernelTable generic_kernels;
// only valid where the CPU has them (checked by the dispatch point below)
extern const KernelTable avx2_kernels;        // AVX2 + FMA + F16C
extern const KernelTable avxvnni_kernels;     // + AVX-VNNI
extern const KernelTable avx512vnni_kernels;  // + AVX-512F/BW/VL/VNNI (512-bit integer GEMM)
extern const KernelTable avx512bf16_kernels;  // + AVX512_BF16 dot products for bf16 weight rows
// avx512bf16's gemm_bf16, for the amx table where the CPU has AVX512_BF16 (every AMX CPU so far)
void gemm_bf16_dp(const GemmArgs& a);
bool cpu_has_avx512bf16();
extern const KernelTable amx_kernels;         // + AMX-INT8 tiles for GEMMs of 16 tokens or more

// The one dispatch point. Returns nullptr for an unknown or unsupported name.
const KernelTable* kernels_for(const char* name);
const KernelTable* best_kernels();
int supported_kernels(const KernelTable** out);  // out holds 8; slowest first
bool cpu_has_avx2();

float fp16_to_fp32(uint16_t h);

}  // namespace moerun
