// CPU kernels whose every output row is a function of its own input row only (AVX2 + FMA, float32; AVX-512 where
// the CPU has it, with the same bits).
//
// Greedy speculative decoding is exact when a tree forward scores each node with the same bits as one-token
// decoding. Here every output element is computed by one thread with one fixed sequence of operations that does not
// depend on how many rows share the call, where they sit, or how many threads run:
//  - grouped_linear: weights kept as GGUF groups of 32 (Q4_1: w = d*q + m, q in 0..15; Q8_0: w = d*q, q int8),
//    each group dequantized in registers into float32 (the very floats gguf's dequantize gives: d*q is exact, so
//    fma(q, d, m) rounds once like (d*q) + m) and used at once for up to eight input rows, so the weights are read
//    and dequantized once per call for each eight rows; for fewer rows, several output features side by side.
//  - int8 linear layers (kernels="int8"): every GGUF type's groups (4-bit or 8-bit codes, scales, mins) against
//    each row's activations rounded to int8, integer products (exact in any order), then one fixed float sequence
//    per output feature (int8.cpp);
//  - attention: softmax(q.k * scale + mask) v per (row, head) over the keys the row sees, gathered in key order
//    first, so masked keys between them (a tree's other branches) change nothing; the query heads that share a
//    key/value head go through together, and so do the rows of a call (a tree's nodes), each key and value read
//    from memory once for all of them; keys and values float32 or float16 (widened exactly on load).
// Then two whole forwards built from those and torch's own ops, in transformers' order (engine/model/fused.py): a
// decoder of the Llama, Qwen2, Qwen3 or Gemma 3 family on grouped layers (Decoder) and an EAGLE-3 head (Eagle3Head),
// without Python between their ops: objects built once, their weights by name, a call passing what changes.
//
// One job a file, all in namespace eagle_cpu, each file's own helpers in an anonymous namespace inside it:
//   kernels.h      what the files share: vector helpers, the 8- and 16-lane traits, the switches, the entry points
//   linear.cpp     grouped_linear: Q4_1 and Q8_0 groups against float32 rows (q4_1_linear, q8_0_linear)
//   int8.cpp       every GGUF type's groups against int8 rows (quantize_rows, the AVX2 and AVX-512 VNNI tiles)
//   attention.cpp  the fixed-order attention (visible_rows, attend, attention)
//   forward.cpp    rms_norm, rotary, the residual stream, Decoder::forward and Eagle3Head::forward
//   weights.cpp    the two forwards' weights by name, checked as a model is built (Decoder, Eagle3Head)
//   ops.cpp        the switches (set_wide, set_vnni), the torch.ops.eagle_cpu registration and the two classes
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/custom_class.h>

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace eagle_cpu {

constexpr int64_t GROUP = 32;  // weights per quantization group
constexpr int64_t LANES = 16;  // output features per int8 tile, one a lane (engine/model/quant.py TILE)

// Whether the linear layers and the attention take their AVX-512 path, and the int8 layers their AVX-512 VNNI one:
// on where the CPU has it; eagle_cpu::set_wide and set_vnni (ops.cpp) turn them off for tests.
extern bool use_wide;
extern bool use_vnni;

inline float hsum(__m256 v) {  // one fixed order: halves, then pairs, then the last two lanes
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The AVX-512 code: each function that uses its intrinsics carries the target, and runs only where
// use_wide (use_vnni) says the CPU has it.
#define WIDE __attribute__((target("avx512f,avx512dq")))

// Keys and values are float32 or float16 (the engine's KV cache, engine/model/cache.py), and so are the int8 layers' group
// scales and mins (float16): eight or sixteen of them widened to float32 exactly, so a float16 cache gives the very
// bits of a float32 one holding the same rounded values.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
WIDE inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
WIDE inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

WIDE inline __m128i two_halves(const void* low, const void* high) {  // 8 bytes from each
  int64_t a, b;
  std::memcpy(&a, low, 8);
  std::memcpy(&b, high, 8);
  return _mm_set_epi64x(b, a);
}

WIDE inline __m512 halves(float low, float high) {
  return _mm512_insertf32x8(_mm512_set1_ps(low), _mm256_set1_ps(high), 1);
}

// ---- 8 and 16 lanes ----
//
// The AVX-512 paths make, lane for lane, the very operations of the 8-lane (AVX2) ones, so a result has the same
// bits on either path and on any x86 CPU (tests/test_quant.py and tests/test_attention.py compare them). Where the
// two have the same shape they share one template body over a lane trait, Lanes8 or Lanes16, and differ only in the
// intrinsics the trait wraps. A Lanes16 vector is two 8-lane blocks: where the 8-lane path gives a vector to one
// output feature, the 16-lane one puts two side by side, block k the 8-lane path's vector of feature k.
//
// GCC cannot give one instantiation of a template its own target, and it cannot inline a function with a target
// into one without it (an always_inline one is an error). So Lanes16's functions carry the target but not
// always_inline, and each 16-lane entry point is WIDE_FLAT: the target, and flatten, which inlines the template body
// and every Lanes16 call in it, so the whole is AVX-512 code without calls. GCC notes (-Wpsabi) that such a body,
// compiled on its own without the target, passes 16-lane vectors to and from Lanes16 with another ABI than
// AVX-512 code; the note is off in the files that include this header: no such call survives the inlining, and no
// function the files share takes or returns a vector.
#pragma GCC diagnostic ignored "-Wpsabi"
#define WIDE_FLAT __attribute__((target("avx512f,avx512dq"), flatten))
#define LANE_OP __attribute__((always_inline)) static

struct Lanes8 {
  using F = __m256;
  using I = __m256i;
  static constexpr int lanes = 8, blocks = 1;
  LANE_OP F zero() { return _mm256_setzero_ps(); }
  LANE_OP F set1(float v) { return _mm256_set1_ps(v); }
  LANE_OP F load(const float* p) { return load8(p); }
  LANE_OP F load(const at::Half* p) { return load8(p); }
  LANE_OP void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  LANE_OP F add(F a, F b) { return _mm256_add_ps(a, b); }
  LANE_OP F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  LANE_OP F div(F a, F b) { return _mm256_div_ps(a, b); }
  LANE_OP F max(F a, F b) { return _mm256_max_ps(a, b); }
  LANE_OP F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  LANE_OP F fnmadd(F a, F b, F c) { return _mm256_fnmadd_ps(a, b, c); }
  LANE_OP F round(F v) { return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  // 2^n for whole n in float's normal range: n + 127 in the exponent's bits.
  LANE_OP F pow2(F n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
  }
  LANE_OP F to_float(I v) { return _mm256_cvtepi32_ps(v); }
  LANE_OP I shift_right(I v, int bits) { return _mm256_srli_epi32(v, bits); }
  LANE_OP I and_bits(I v, int mask) { return _mm256_and_si256(v, _mm256_set1_epi32(mask)); }
  // Blocks: p[0 .. 7] in each; p[k * step] in block k; the 8 bytes from p + k * step widened into block k.
  LANE_OP F repeat(const float* p) { return _mm256_loadu_ps(p); }
  LANE_OP F per_block(const float* p, int64_t) { return _mm256_set1_ps(*p); }
  LANE_OP I widen_u8(const uint8_t* p, int64_t) {  // widened at once: the load folds into it
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  }
  LANE_OP I widen_i8(const int8_t* p, int64_t) {
    return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  }
  LANE_OP __m256 block(F v, int) { return v; }  // block k as an 8-lane vector
};

#define WIDE_LANE_OP WIDE static

struct Lanes16 {
  using F = __m512;
  using I = __m512i;
  static constexpr int lanes = 16, blocks = 2;
  WIDE_LANE_OP F zero() { return _mm512_setzero_ps(); }
  WIDE_LANE_OP F set1(float v) { return _mm512_set1_ps(v); }
  WIDE_LANE_OP F load(const float* p) { return load16(p); }
  WIDE_LANE_OP F load(const at::Half* p) { return load16(p); }
  WIDE_LANE_OP void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  WIDE_LANE_OP F add(F a, F b) { return _mm512_add_ps(a, b); }
  WIDE_LANE_OP F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  WIDE_LANE_OP F div(F a, F b) { return _mm512_div_ps(a, b); }
  WIDE_LANE_OP F max(F a, F b) { return _mm512_max_ps(a, b); }
  WIDE_LANE_OP F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  WIDE_LANE_OP F fnmadd(F a, F b, F c) { return _mm512_fnmadd_ps(a, b, c); }
  WIDE_LANE_OP F round(F v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  WIDE_LANE_OP F pow2(F n) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
  }
  WIDE_LANE_OP F to_float(I v) { return _mm512_cvtepi32_ps(v); }
  WIDE_LANE_OP I shift_right(I v, int bits) { return _mm512_srli_epi32(v, bits); }
  WIDE_LANE_OP I and_bits(I v, int mask) { return _mm512_and_si512(v, _mm512_set1_epi32(mask)); }
  WIDE_LANE_OP F repeat(const float* p) { return _mm512_broadcast_f32x8(_mm256_loadu_ps(p)); }
  WIDE_LANE_OP F per_block(const float* p, int64_t step) { return halves(p[0], p[step]); }
  WIDE_LANE_OP I widen_u8(const uint8_t* p, int64_t step) { return _mm512_cvtepu8_epi32(two_halves(p, p + step)); }
  WIDE_LANE_OP I widen_i8(const int8_t* p, int64_t step) { return _mm512_cvtepi8_epi32(two_halves(p, p + step)); }
  WIDE_LANE_OP __m256 block(F v, int k) { return k ? _mm512_extractf32x8_ps(v, 1) : _mm512_castps512_ps256(v); }
};

#undef LANE_OP
#undef WIDE_LANE_OP

// at::parallel_for's split of [begin, end) (one contiguous chunk a thread, none shorter than `grain`, the calling
// thread alone where one chunk covers it or inside a parallel region), on OpenMP directly. at::parallel_for also
// carries torch's thread-local state into every worker, ~0.5 us a call that loops calling no torch op do not need,
// and a decoding step makes some 300 such calls. f must not throw.
template <typename F>
void parallel_chunks(int64_t begin, int64_t end, int64_t grain, const F& f) {
  const int64_t range = end - begin;
  if (range <= 0) return;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), (range + grain - 1) / grain);
  if (threads <= 1 || omp_in_parallel()) {
    f(begin, end);
    return;
  }
  const int64_t chunk = (range + threads - 1) / threads;
#pragma omp parallel num_threads(threads)
  {
    const int64_t first = begin + omp_get_thread_num() * chunk;
    if (first < end) f(first, std::min(end, first + chunk));
  }
}

// ---- what the files take from each other ----

template <typename T>
struct Heads {  // strided [B, H, L, D] views, D contiguous
  T* data;
  int64_t batch, head, pos;
  T* at(int64_t b, int64_t h, int64_t p) const { return data + b * batch + h * head + p * pos; }
};

template <typename T>
Heads<T> heads_of(const at::Tensor& t) {
  TORCH_CHECK(t.scalar_type() == c10::CppTypeToScalarType<T>::value && t.dim() == 4 && t.stride(3) == 1,
              "attention takes float32 queries and float32 or float16 keys and values [B, heads, length, head_dim] "
              "with a contiguous last dimension");
  return {t.data_ptr<T>(), t.stride(0), t.stride(1), t.stride(2)};
}

// linear.cpp: x [.., in] against Q4_1 or Q8_0 groups [out_features, ..] (+ bias), float32 [.., out_features].
at::Tensor q4_1_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& mins,
                       const std::optional<at::Tensor>& bias);
at::Tensor q8_0_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                       const std::optional<at::Tensor>& bias);

// int8.cpp: a GGUF type's groups, repacked (engine/model/quant.py repack), against int8 rows.
struct Int8Layer {
  const void* codes;   // [tiles, groups, chunks, 16, 4]: 4-bit nibble pairs (4 chunks) or int8 (8 chunks)
  const void* scales;  // [tiles, groups, (2,) 16], float16 or float32 (int8 where block_scales multiply them)
  const void* mins;    // [tiles, groups, 16] of the scales' dtype, or null
  const at::Half *block_scales, *block_mins;  // a K-quant's [tiles, groups / 8, 16], or null
  int64_t groups, blocks, out_features;
  bool q4, halves, float_scales;
};
Int8Layer int8_layer(const at::Tensor& codes, const at::Tensor& scales, const std::optional<at::Tensor>& mins,
                     const std::optional<at::Tensor>& block_scales, const std::optional<at::Tensor>& block_mins,
                     int64_t out_features, int64_t in_features);
// x [.., in] against each layer (+ its bias, or null): float32 [.., sum of out_features], the layers side by side.
at::Tensor int8_linears(const at::Tensor& x, const std::vector<Int8Layer>& layers,
                        const std::vector<const float*>& biases);
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                       const std::optional<at::Tensor>& mins, const std::optional<at::Tensor>& block_scales,
                       const std::optional<at::Tensor>& block_mins, const std::optional<at::Tensor>& bias,
                       int64_t out_features);
// Rows `ids` of such a table as the float32 weights its groups stand for, scale * q (+ min) as gguf-py rounds them:
// an embedding's lookup from the int8 kernels' own copy of the table. float32 [ids.., in].
at::Tensor int8_rows(const at::Tensor& ids, const at::Tensor& codes, const at::Tensor& scales,
                     const std::optional<at::Tensor>& mins, const std::optional<at::Tensor>& block_scales,
                     const std::optional<at::Tensor>& block_mins, int64_t out_features);

// attention.cpp
// The keys one query row sees, in key order, with their additive mask values: the same for every head of the row.
struct Visible {
  std::vector<int64_t> keys;
  std::vector<float> bias;
  int64_t count() const { return static_cast<int64_t>(keys.size()); }
};
std::vector<Visible> visible_rows(const std::optional<at::Tensor>& mask, int64_t batch, int64_t rows, int64_t length);
at::Tensor attend(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                  const std::vector<Visible>& visible, double scale);
at::Tensor attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                     const std::optional<at::Tensor>& mask, double scale);

// forward.cpp: rms_norm (the kernels' RMSNorm, transformers' bits), and the two whole forwards as objects built once,
// when a model is prepared (engine/model/fused.py, engine/draft/fused.py): the weights handed by name and checked then
// (weights.cpp), a call passing only what changes from call to call.
int64_t torch_sum_lanes();
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);

// weights.cpp
// A grouped linear layer: its tensors (undefined where absent) for the float kernels (codes, scales, Q4_1's mins) or
// the int8 ones (block scales and mins too), and its bias.
struct Linear {
  at::Tensor codes, scales, mins, block_scales, block_mins, bias;
  int64_t out_features = 0;
};
// The int8 kernels' view of a linear layer's groups, for inputs of `in_features` (taken at each call, from the
// tensors as they are then).
Int8Layer int8_layer(const Linear& w, int64_t in_features);

inline std::optional<at::Tensor> maybe(const at::Tensor& t) {  // an absent (undefined) tensor as an absent argument
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}

// A decoder layer: its norms' weights as the kernels multiply by them (w, or Gemma's 1 + w; undefined where the
// family has no norm there), and its projections.
enum Norm { INPUT, POST_ATTENTION, PRE_MLP, POST_MLP, Q_NORM, K_NORM, NORMS };
enum Projection { Q, K, V, O, GATE, UP, DOWN, PROJECTIONS };
struct Layer {
  std::array<at::Tensor, NORMS> norms;
  std::array<Linear, PROJECTIONS> projections;
};

// The dimensions a model's weights have, given by name when it is built.
struct Shape {
  int64_t hidden, heads, kv_heads, head_dim, intermediate;
};

using Dimensions = c10::Dict<std::string, int64_t>;
using NamedWeights = c10::Dict<std::string, at::Tensor>;
// What a call passes, grouped: the rotary tables [1, M, head_dim] (cos, sin, then the sliding layers' own where they
// have their own); a head's tokens (their ids, and their embeddings where the head holds no table); a head's cache
// (key and value buffers and the position this call's rows go in at).
using Rotary = std::tuple<at::Tensor, at::Tensor, std::optional<at::Tensor>, std::optional<at::Tensor>>;
using Tokens = std::tuple<at::Tensor, std::optional<at::Tensor>>;
using CacheView = std::tuple<at::Tensor, at::Tensor, int64_t>;

// A decoder-only model of the Llama, Qwen2, Qwen3 or Gemma 3 family on grouped layers
// (torch.classes.eagle_cpu.Decoder).
struct Decoder : torch::CustomClassHolder {
  // dimensions: hidden, heads, kv_heads, head_dim, intermediate; sliding: per layer whether it is a sliding-window
  // one; weights: final_norm, and each layer's under layers.<i>. (weights.cpp names them).
  Decoder(const Dimensions& dimensions, double eps, double scale, bool gelu, bool int8,
          const c10::List<bool>& sliding, const NamedWeights& weights);
  std::tuple<at::Tensor, std::vector<at::Tensor>> forward(const at::Tensor& embeddings, const Rotary& rotary,
                                                          const std::optional<at::Tensor>& mask,
                                                          const std::optional<at::Tensor>& sliding_mask,
                                                          const std::vector<at::Tensor>& caches, int64_t start,
                                                          const std::vector<int64_t>& capture) const;

  Shape shape;
  double eps, scale;
  bool gelu, int8;
  std::vector<bool> sliding;
  std::vector<Layer> layers;
  at::Tensor final_norm;
};

// An EAGLE-3 head on grouped layers (torch.classes.eagle_cpu.Eagle3Head).
struct Eagle3Head : torch::CustomClassHolder {
  // dimensions: hidden, heads, kv_heads, head_dim, intermediate, features (fc's inputs), vocab (the base's table's
  // rows, 0 without one), draft_vocab; weights: its layer's, hidden_norm, fc, final_norm, lm_head, and the base's
  // int8 embedding table where the head reads it itself (weights.cpp names them).
  Eagle3Head(const Dimensions& dimensions, double eps, bool int8, const NamedWeights& weights);
  void set_rotary(const at::Tensor& cos, const at::Tensor& sin);
  std::tuple<at::Tensor, std::optional<at::Tensor>> forward(const at::Tensor& hidden, const Tokens& tokens,
                                                            const at::Tensor& positions,
                                                            const std::optional<at::Tensor>& mask,
                                                            const CacheView& cache, bool from_target,
                                                            bool logits) const;

  Shape shape;
  int64_t features, vocab, draft_vocab;
  double eps;
  bool int8;
  Layer layer;
  at::Tensor hidden_norm, final_norm, embedding_scale;
  Linear fc, lm_head;
  std::optional<Linear> embedding;
  at::Tensor cos, sin;  // the rotary tables [P, head_dim], set_rotary's
};

}  // namespace eagle_cpu
