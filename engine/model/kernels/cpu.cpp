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
//  - int8 linear layers (kernels="int8"): the same groups against each row's activations rounded to int8, integer
//    products (exact in any order), then one fixed float sequence per output feature (section "int8 activations");
//  - attention: softmax(q.k * scale + mask) v per (row, head) over the keys the row sees, gathered in key order
//    first, so masked keys between them (a tree's other branches) change nothing; the query heads that share a
//    key/value head go through together, and so do the rows of a call (a tree's nodes), each key and value read
//    from memory once for all of them; keys and values float32 or float16 (widened exactly on load).
// Then two whole forwards built from those and torch's own ops, in transformers' order (engine/model/fused.py): a q4
// Llama's decoder (llama_forward) and an EAGLE-3 head's layer (eagle3_layer), without Python between their ops.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <numeric>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t GROUP = 32;  // weights per quantization group
constexpr int64_t TILE = 8;    // output features per task unit

float hsum(__m256 v) {  // one fixed order: halves, then pairs, then the last two lanes
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// hsum of four vectors at once, [hsum(a0), hsum(a1), hsum(a2), hsum(a3)]: the very additions hsum makes for each
// (halves, then pairs, then the last two lanes), with the four vectors' lanes side by side.
__m128 hsum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 s01 = _mm256_add_ps(_mm256_permute2f128_ps(a0, a1, 0x20), _mm256_permute2f128_ps(a0, a1, 0x31));
  const __m256 s23 = _mm256_add_ps(_mm256_permute2f128_ps(a2, a3, 0x20), _mm256_permute2f128_ps(a2, a3, 0x31));
  const __m256 pairs = _mm256_add_ps(_mm256_shuffle_ps(s01, s23, _MM_SHUFFLE(1, 0, 1, 0)),
                                     _mm256_shuffle_ps(s01, s23, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 sums = _mm256_add_ps(_mm256_shuffle_ps(pairs, pairs, _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm256_shuffle_ps(pairs, pairs, _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm_unpacklo_ps(_mm256_castps256_ps128(sums), _mm256_extractf128_ps(sums, 1));  // sums: a0 a2 | a1 a3
}

__m256 bytes_to_float(__m128i eight_bytes_low, bool is_signed) {
  __m256i wide = is_signed ? _mm256_cvtepi8_epi32(eight_bytes_low) : _mm256_cvtepu8_epi32(eight_bytes_low);
  return _mm256_cvtepi32_ps(wide);
}

// AVX-512 where the CPU has it: two output features in one 16-lane vector, each lane making the very operations
// of the 8-lane path (same loads, conversions, FMAs in the same order, the same hsum of each half), so a result has
// the same bits on either path and on any x86 CPU (tests/test_quant.py compares them); half the instructions.
#define WIDE __attribute__((target("avx512f,avx512dq")))

WIDE __m128i two_halves(const void* low, const void* high) {  // 8 bytes from each
  int64_t a, b;
  std::memcpy(&a, low, 8);
  std::memcpy(&b, high, 8);
  return _mm_set_epi64x(b, a);
}

WIDE __m512 halves(float low, float high) {
  return _mm512_insertf32x8(_mm512_set1_ps(low), _mm256_set1_ps(high), 1);
}

// Part p (elements 8p..8p+7) of the 32 weights of group g of one output feature, dequantized into float32.
// Q4_1: 16 bytes per group, byte j holding element j (low nibble) and element j + 16 (high nibble).
struct Q4_1 {
  // Output features multiplied side by side for `rows` input rows (fastest on AVX2 Zen 3, measured 1-8 rows).
  static constexpr int feats(int rows) { return rows == 1 ? 4 : rows <= 3 ? 2 : 1; }
  const uint8_t* codes;
  const float *scales, *mins;
  int64_t in;
  __m256 part(int64_t row, int64_t g, int p) const {
    const int64_t at = row * (in / GROUP) + g;
    const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + at * GROUP / 2 + (p & 1) * 8));
    __m256i wide = _mm256_cvtepu8_epi32(raw);  // widened first: the load folds into it, nibbles split per lane
    if (p >= 2) wide = _mm256_srli_epi32(wide, 4);
    const __m256 q = _mm256_cvtepi32_ps(_mm256_and_si256(wide, _mm256_set1_epi32(0x0F)));
    return _mm256_fmadd_ps(q, _mm256_set1_ps(scales[at]), _mm256_set1_ps(mins[at]));
  }
  // part() of features `row` (lanes 0-7) and `row + 1` (lanes 8-15) in one vector: lane for lane the same operations.
  WIDE __m512 pair(int64_t row, int64_t g, int p) const {
    const int64_t at = row * (in / GROUP) + g, next = at + in / GROUP;
    const __m512i wide = _mm512_cvtepu8_epi32(two_halves(codes + at * GROUP / 2 + (p & 1) * 8,
                                                         codes + next * GROUP / 2 + (p & 1) * 8));
    const __m512i nibbles = p >= 2 ? _mm512_srli_epi32(wide, 4) : wide;
    const __m512 q = _mm512_cvtepi32_ps(_mm512_and_si512(nibbles, _mm512_set1_epi32(0x0F)));
    return _mm512_fmadd_ps(q, halves(scales[at], scales[next]), halves(mins[at], mins[next]));
  }
};

// Q8_0: 32 signed bytes per group.
struct Q8_0 {
  static constexpr int feats(int rows) { return rows <= 5 ? 2 : 1; }  // its dequantization is cheaper: more rows
  const int8_t* codes;
  const float* scales;
  int64_t in;
  __m256 part(int64_t row, int64_t g, int p) const {
    const int64_t at = row * (in / GROUP) + g;
    const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + at * GROUP + p * 8));
    return _mm256_mul_ps(bytes_to_float(raw, true), _mm256_set1_ps(scales[at]));
  }
  WIDE __m512 pair(int64_t row, int64_t g, int p) const {
    const int64_t at = row * (in / GROUP) + g, next = at + in / GROUP;
    const __m512i wide = _mm512_cvtepi8_epi32(two_halves(codes + at * GROUP + p * 8, codes + next * GROUP + p * 8));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(wide), halves(scales[at], scales[next]));
  }
};

// ROWS input rows against FEATS output features at once: each group of a feature's weights dequantized in registers
// and used at once for every row. Per output, one 8-lane accumulator sums the group's four vectors in order, group
// after group, then hsum: the same operations whatever ROWS and FEATS are, so a row's bits never depend on the rows
// beside it. Several features side by side give the FMA units independent chains to overlap (one feature and one row
// would wait on each FMA's latency) and share each load of x. (Dequantizing a tile to memory first cost twice as much
// for 2-16 rows; measured.)
template <int ROWS, int FEATS, typename Format>
__attribute__((always_inline)) inline void multiply_block(const float* x, const Format& format, int64_t n0,
                                                         const float* bias, float* out, int64_t out_stride) {
  const int64_t in = format.in;
  __m256 acc[ROWS * FEATS];
  for (int a = 0; a < ROWS * FEATS; ++a) acc[a] = _mm256_setzero_ps();
  for (int64_t g = 0; g < in / GROUP; ++g)
    for (int part = 0; part < 4; ++part) {
      __m256 xv[ROWS];
      for (int i = 0; i < ROWS; ++i) xv[i] = _mm256_loadu_ps(x + i * in + g * GROUP + 8 * part);
      for (int f = 0; f < FEATS; ++f) {
        const __m256 w = format.part(n0 + f, g, part);
        for (int i = 0; i < ROWS; ++i) acc[i * FEATS + f] = _mm256_fmadd_ps(xv[i], w, acc[i * FEATS + f]);
      }
    }
  for (int i = 0; i < ROWS; ++i)
    for (int f = 0; f < FEATS; ++f) out[i * out_stride + f] = hsum(acc[i * FEATS + f]) + (bias ? bias[f] : 0.f);
}

// multiply_block for 2 * PAIRS features, two to a vector.
template <int ROWS, int PAIRS, typename Format>
WIDE __attribute__((always_inline)) inline void multiply_pairs(const float* x, const Format& format, int64_t n0,
                                                               const float* bias, float* out, int64_t out_stride) {
  const int64_t in = format.in;
  __m512 acc[ROWS * PAIRS];
  for (int a = 0; a < ROWS * PAIRS; ++a) acc[a] = _mm512_setzero_ps();
  for (int64_t g = 0; g < in / GROUP; ++g)
    for (int part = 0; part < 4; ++part) {
      __m512 xv[ROWS];
      for (int i = 0; i < ROWS; ++i) xv[i] = _mm512_broadcast_f32x8(_mm256_loadu_ps(x + i * in + g * GROUP + 8 * part));
      for (int f = 0; f < PAIRS; ++f) {
        const __m512 w = format.pair(n0 + 2 * f, g, part);
        for (int i = 0; i < ROWS; ++i) acc[i * PAIRS + f] = _mm512_fmadd_ps(xv[i], w, acc[i * PAIRS + f]);
      }
    }
  for (int i = 0; i < ROWS; ++i)
    for (int f = 0; f < PAIRS; ++f) {
      const __m512 a = acc[i * PAIRS + f];
      out[i * out_stride + 2 * f] = hsum(_mm512_castps512_ps256(a)) + (bias ? bias[2 * f] : 0.f);
      out[i * out_stride + 2 * f + 1] = hsum(_mm512_extractf32x8_ps(a, 1)) + (bias ? bias[2 * f + 1] : 0.f);
    }
}

template <int ROWS, typename Format>
WIDE void multiply_tile_wide(const float* x, const Format& format, int64_t n0, int64_t valid, const float* bias,
                             float* out, int64_t out_stride) {
  constexpr int PAIRS = ROWS <= 4 ? 2 : 1;  // measured on Zen 5, 1-8 rows
  int64_t f = 0;
  for (; f + 2 * PAIRS <= valid; f += 2 * PAIRS)
    multiply_pairs<ROWS, PAIRS>(x, format, n0 + f, bias ? bias + f : nullptr, out + f, out_stride);
  for (; f + 2 <= valid; f += 2)
    multiply_pairs<ROWS, 1>(x, format, n0 + f, bias ? bias + f : nullptr, out + f, out_stride);
  for (; f < valid; ++f) multiply_block<ROWS, 1>(x, format, n0 + f, bias ? bias + f : nullptr, out + f, out_stride);
}

bool cpu_has_avx512() {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq");
  return has;
}

bool use_wide = cpu_has_avx512();  // eagle_cpu::set_wide turns it off for tests

// ROWS rows against the tile's `valid` features, FEATS at a time (the fewer rows, the more side by side).
template <int ROWS, typename Format>
void multiply_tile(const float* x, const Format& format, int64_t n0, int64_t valid, const float* bias, float* out,
                   int64_t out_stride) {
  constexpr int FEATS = Format::feats(ROWS);
  int64_t f = 0;
  for (; f + FEATS <= valid; f += FEATS)
    multiply_block<ROWS, FEATS>(x, format, n0 + f, bias ? bias + f : nullptr, out + f, out_stride);
  for (; f < valid; ++f) multiply_block<ROWS, 1>(x, format, n0 + f, bias ? bias + f : nullptr, out + f, out_stride);
}

template <int ROWS, typename Format>
void tile(bool wide, const float* x, const Format& format, int64_t n0, int64_t valid, const float* bias, float* out,
          int64_t out_stride) {
  if (wide) {
    multiply_tile_wide<ROWS>(x, format, n0, valid, bias, out, out_stride);
  } else {
    multiply_tile<ROWS>(x, format, n0, valid, bias, out, out_stride);
  }
}

// Every row through a tile, eight at a time.
template <typename Format>
void multiply_rows(const float* x, int64_t rows, const Format& format, int64_t n0, int64_t valid, const float* bias,
                   float* out, int64_t out_stride) {
  const bool wide = use_wide;
  for (int64_t i = 0; i < rows; i += 8) {
    const float* xi = x + i * format.in;
    float* o = out + i * out_stride;
    switch (std::min<int64_t>(8, rows - i)) {
      case 1: tile<1>(wide, xi, format, n0, valid, bias, o, out_stride); break;
      case 2: tile<2>(wide, xi, format, n0, valid, bias, o, out_stride); break;
      case 3: tile<3>(wide, xi, format, n0, valid, bias, o, out_stride); break;
      case 4: tile<4>(wide, xi, format, n0, valid, bias, o, out_stride); break;
      case 5: tile<5>(wide, xi, format, n0, valid, bias, o, out_stride); break;
      case 6: tile<6>(wide, xi, format, n0, valid, bias, o, out_stride); break;
      case 7: tile<7>(wide, xi, format, n0, valid, bias, o, out_stride); break;
      default: tile<8>(wide, xi, format, n0, valid, bias, o, out_stride);
    }
  }
}

template <typename Format>
at::Tensor grouped_linear(const at::Tensor& x, int64_t out_features, const std::optional<at::Tensor>& bias,
                          const Format& format) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "grouped_linear takes float32 inputs, got ", x.scalar_type());
  const int64_t in = x.size(-1);
  TORCH_CHECK(in % GROUP == 0, "grouped_linear needs in_features divisible by ", GROUP, ", got ", in);
  const at::Tensor rows = x.reshape({-1, in}).contiguous();
  const int64_t count = rows.size(0);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = out_features;
  at::Tensor out = at::empty({count, out_features}, x.options());
  const float* xs = rows.data_ptr<float>();
  float* os = out.data_ptr<float>();
  const float* bs = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  const int64_t tiles = (out_features + TILE - 1) / TILE;
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / (TILE * in));  // ~64k weights per task at least
  at::parallel_for(0, tiles, grain, [&](int64_t first, int64_t last) {
    for (int64_t t = first; t < last; ++t) {
      const int64_t n0 = t * TILE, valid = std::min(TILE, out_features - n0);
      multiply_rows(xs, count, format, n0, valid, bs ? bs + n0 : nullptr, os + n0, out_features);
    }
  });
  return out.view(shape);
}

void check_groups(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, int64_t codes_per_row) {
  const int64_t in = x.size(-1);
  TORCH_CHECK(codes.dim() == 2 && codes.is_contiguous() && codes.size(1) == codes_per_row,
              "codes must be a contiguous [out_features, ", codes_per_row, "] tensor for ", in, " inputs");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  scales.sizes() == at::IntArrayRef({codes.size(0), in / GROUP}),
              "scales must be contiguous float32 [out_features, in_features / 32]");
}

at::Tensor q4_1_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& mins,
                       const std::optional<at::Tensor>& bias) {
  const int64_t in = x.size(-1);
  TORCH_CHECK(codes.scalar_type() == at::kByte, "Q4_1 codes are uint8");
  check_groups(x, codes, scales, in / 2);
  TORCH_CHECK(mins.sizes() == scales.sizes() && mins.is_contiguous() && mins.scalar_type() == at::kFloat,
              "mins must match scales");
  return grouped_linear(x, codes.size(0), bias,
                        Q4_1{codes.data_ptr<uint8_t>(), scales.data_ptr<float>(), mins.data_ptr<float>(), in});
}

at::Tensor q8_0_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                       const std::optional<at::Tensor>& bias) {
  const int64_t in = x.size(-1);
  TORCH_CHECK(codes.scalar_type() == at::kChar, "Q8_0 codes are int8");
  check_groups(x, codes, scales, in);
  return grouped_linear(x, codes.size(0), bias, Q8_0{codes.data_ptr<int8_t>(), scales.data_ptr<float>(), in});
}

// ---- int8 activations (kernels="int8"): llama.cpp's arithmetic on the GGUF's groups ----
//
// Each input row is rounded on its own, group by group: d = max|x| / 127, q = x / d rounded to nearest even, s =
// sum(q). A group's dot product with a weight group is then an integer sum, exact on any path in any order, and only
// its scaling is float, one fixed sequence per output feature, group after group:
//   acc = acc + float(sum(qw * q)) * (dw * d)      Q4_1 also: mins = mins + mw * (d * float(s))
// then out = acc (+ mins) (+ bias). The weights are repacked at load (engine/model/quant.py repack) so that a vector lane is
// an output feature: 16 features a tile, for each group 8 chunks of 4 consecutive weights of every feature, 64
// bytes a chunk (Q4_1: chunks c and c + 4 in one byte's low and high nibbles, as GGUF pairs weights j and j + 16);
// scales and mins [tile, group, 16]. One instruction multiplies 4 weights of 16 features by 4 activations
// broadcast: with AVX-512 VNNI (vpdpbusd) 64 products, with AVX2 two instructions for 8 features; either way the
// integers are exact and the float steps are lane for lane the same, so both paths give the same bits, and a
// row's result never depends on the rows beside it.
constexpr int64_t LANES = 16;  // output features per int8 tile, one a lane (engine/model/quant.py TILE)

struct Int8Rows {
  std::vector<int8_t> q;   // [rows, in]
  std::vector<float> d;    // [rows, in / 32]
  std::vector<float> ds;   // d * float(s)
  std::vector<int32_t> s;  // sum of a group's q
};

// Eight lanes at a time, with the scalar definition's every result: max|x| is exact in any order (a NaN lane keeps
// the running max, as std::max(most, NaN) does), each q is x * inverse rounded in the current (nearest-even) mode and
// truncated, its low byte stored as a cast keeps it, and the integer sum wraps alike in any order.
Int8Rows quantize_rows(const float* x, int64_t rows, int64_t in) {
  const int64_t groups = rows * (in / GROUP);
  Int8Rows r;
  r.q.resize(rows * in), r.d.resize(groups), r.ds.resize(groups), r.s.resize(groups);
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256i low_bytes = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                             0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
  for (int64_t i = 0; i < groups; ++i) {
    const float* xs = x + i * GROUP;
    __m256 v[GROUP / 8], top = _mm256_setzero_ps();
    for (int k = 0; k < GROUP / 8; ++k) {
      v[k] = _mm256_loadu_ps(xs + 8 * k);
      top = _mm256_max_ps(_mm256_and_ps(v[k], magnitude), top);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, top);
    const float most = *std::max_element(lanes, lanes + 8);
    const float d = most / 127.f, inverse = d != 0.f ? 1.f / d : 0.f;
    __m256i sums = _mm256_setzero_si256();
    for (int k = 0; k < GROUP / 8; ++k) {
      const __m256 scaled = _mm256_mul_ps(v[k], _mm256_set1_ps(inverse));
      const __m256i q = _mm256_cvttps_epi32(_mm256_round_ps(scaled, _MM_FROUND_CUR_DIRECTION | _MM_FROUND_NO_EXC));
      sums = _mm256_add_epi32(sums, q);
      const __m256i bytes = _mm256_shuffle_epi8(q, low_bytes);
      const int32_t low = _mm256_extract_epi32(bytes, 0), high = _mm256_extract_epi32(bytes, 4);
      std::memcpy(r.q.data() + i * GROUP + 8 * k, &low, 4);
      std::memcpy(r.q.data() + i * GROUP + 8 * k + 4, &high, 4);
    }
    int32_t each[8];
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(each), sums);
    const int32_t sum = std::accumulate(each, each + 8, 0);
    r.d[i] = d, r.s[i] = sum, r.ds[i] = d * static_cast<float>(sum);
  }
  return r;
}

// Keys and values are float32 or float16 (the engine's KV cache, engine/model/cache.py), and so are the int8 layers' group
// scales and mins (float16): eight or sixteen of them widened to float32 exactly, so a float16 cache gives the very
// bits of a float32 one holding the same rounded values.
__m256 load8(const float* p) { return _mm256_loadu_ps(p); }
__m256 load8(const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
WIDE __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
WIDE __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

struct Int8Layer {
  const uint8_t* codes;          // [tiles, groups, chunks, 16, 4] (Q4_1: 4 chunks of nibble pairs; Q8_0: 8 of int8)
  const at::Half *scales, *mins;  // [tiles, groups, 16], float16 as GGUF stores them: widened exactly on load
  int64_t groups;
};

int32_t load4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// Half h (features 8h .. 8h + 7) of tile t for ROWS rows, AVX2.
template <int ROWS, bool Q4>
void int8_half_avx2(const Int8Layer& w, const Int8Rows& x, int64_t row0, int64_t t, int h, float (*out)[8]) {
  const __m256i nibble = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 acc[ROWS], mins[ROWS];
  for (int i = 0; i < ROWS; ++i) acc[i] = mins[i] = _mm256_setzero_ps();
  for (int64_t g = 0; g < w.groups; ++g) {
    const int64_t tg = t * w.groups + g;
    const uint8_t* c = w.codes + tg * (Q4 ? 256 : 512) + 32 * h;
    __m256i lanes[8], magnitudes[8];  // Q4_1: the 8 chunks' weights 0..15; Q8_0: the signed weights and |w|
    if (Q4) {
      for (int r = 0; r < 4; ++r) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 64 * r));
        lanes[r] = _mm256_and_si256(v, nibble);
        lanes[r + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
      }
    } else {
      for (int r = 0; r < 8; ++r) {
        lanes[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 64 * r));
        magnitudes[r] = _mm256_abs_epi8(lanes[r]);
      }
    }
    const __m256 dw = load8(w.scales + tg * LANES + 8 * h);
    const __m256 mw = Q4 ? load8(w.mins + tg * LANES + 8 * h) : _mm256_setzero_ps();
    for (int i = 0; i < ROWS; ++i) {
      const int64_t at = (row0 + i) * w.groups + g;
      const int8_t* xq = x.q.data() + at * GROUP;
      __m256i sums = _mm256_setzero_si256();
      for (int r = 0; r < 8; ++r) {
        const __m256i xv = _mm256_set1_epi32(load4(xq + 4 * r));
        const __m256i pairs = Q4 ? _mm256_maddubs_epi16(lanes[r], xv)
                                 : _mm256_maddubs_epi16(magnitudes[r], _mm256_sign_epi8(xv, lanes[r]));
        sums = _mm256_add_epi32(sums, _mm256_madd_epi16(pairs, ones));
      }
      const __m256 dd = _mm256_mul_ps(dw, _mm256_set1_ps(x.d[at]));
      acc[i] = _mm256_add_ps(acc[i], _mm256_mul_ps(_mm256_cvtepi32_ps(sums), dd));
      if (Q4) mins[i] = _mm256_add_ps(mins[i], _mm256_mul_ps(mw, _mm256_set1_ps(x.ds[at])));
    }
  }
  for (int i = 0; i < ROWS; ++i) _mm256_storeu_ps(out[i], Q4 ? _mm256_add_ps(acc[i], mins[i]) : acc[i]);
}

#define VNNI __attribute__((target("avx512f,avx512bw,avx512dq,avx512vnni")))

bool cpu_has_vnni() {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vnni");
  return has;
}

bool use_vnni = cpu_has_vnni();  // eagle_cpu::set_vnni turns it off for tests

// Tile t for ROWS rows, AVX-512 VNNI: the weights go in as unsigned bytes (Q8_0's shifted by 128, and 128 * s taken
// off the integer sum after).
template <int ROWS, bool Q4>
VNNI void int8_tile_vnni(const Int8Layer& w, const Int8Rows& x, int64_t row0, int64_t t, float (*out)[LANES]) {
  const __m512i nibble = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc[ROWS], mins[ROWS];
  for (int i = 0; i < ROWS; ++i) acc[i] = mins[i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < w.groups; ++g) {
    const int64_t tg = t * w.groups + g;
    const uint8_t* c = w.codes + tg * (Q4 ? 256 : 512);
    __m512i lanes[8];
    if (Q4) {
      for (int r = 0; r < 4; ++r) {
        const __m512i v = _mm512_loadu_si512(c + 64 * r);
        lanes[r] = _mm512_and_si512(v, nibble);
        lanes[r + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
      }
    } else {
      for (int r = 0; r < 8; ++r) lanes[r] = _mm512_xor_si512(_mm512_loadu_si512(c + 64 * r), flip);
    }
    const __m512 dw = load16(w.scales + tg * LANES);
    const __m512 mw = Q4 ? load16(w.mins + tg * LANES) : _mm512_setzero_ps();
    for (int i = 0; i < ROWS; ++i) {
      const int64_t at = (row0 + i) * w.groups + g;
      const int8_t* xq = x.q.data() + at * GROUP;
      __m512i sums = _mm512_setzero_si512();
      for (int r = 0; r < 8; ++r) sums = _mm512_dpbusd_epi32(sums, lanes[r], _mm512_set1_epi32(load4(xq + 4 * r)));
      if (!Q4) sums = _mm512_sub_epi32(sums, _mm512_set1_epi32(128 * x.s[at]));
      const __m512 dd = _mm512_mul_ps(dw, _mm512_set1_ps(x.d[at]));
      acc[i] = _mm512_add_ps(acc[i], _mm512_mul_ps(_mm512_cvtepi32_ps(sums), dd));
      if (Q4) mins[i] = _mm512_add_ps(mins[i], _mm512_mul_ps(mw, _mm512_set1_ps(x.ds[at])));
    }
  }
  for (int i = 0; i < ROWS; ++i) _mm512_storeu_ps(out[i], Q4 ? _mm512_add_ps(acc[i], mins[i]) : acc[i]);
}

// Tile t for rows row0 .. row0 + ROWS - 1 into a [ROWS][LANES] block.
template <int ROWS, bool Q4>
void int8_tile(bool vnni, const Int8Layer& w, const Int8Rows& x, int64_t row0, int64_t t, float (*block)[LANES]) {
  if (vnni) {
    int8_tile_vnni<ROWS, Q4>(w, x, row0, t, block);
    return;
  }
  for (int h = 0; h < 2; ++h) {
    float half[ROWS][8];
    int8_half_avx2<ROWS, Q4>(w, x, row0, t, h, half);
    for (int i = 0; i < ROWS; ++i) std::memcpy(block[i] + 8 * h, half[i], sizeof half[i]);
  }
}

template <bool Q4>
at::Tensor int8_linear(const at::Tensor& x, const Int8Layer& w, int64_t out_features,
                       const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "int8 linear layers take float32 inputs, got ", x.scalar_type());
  const int64_t in = x.size(-1);
  TORCH_CHECK(in == w.groups * GROUP, "int8 linear layer: ", in, " inputs for a layer of ", w.groups * GROUP);
  const at::Tensor rows = x.reshape({-1, in}).contiguous();
  const int64_t count = rows.size(0);
  const Int8Rows xq = quantize_rows(rows.data_ptr<float>(), count, in);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = out_features;
  at::Tensor out = at::empty({count, out_features}, x.options());
  float* os = out.data_ptr<float>();
  const float* bs = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  const bool vnni = use_vnni;
  const int64_t tiles = (out_features + LANES - 1) / LANES;
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / (LANES * in));
  at::parallel_for(0, tiles, grain, [&](int64_t first, int64_t last) {
    float block[4][LANES];
    for (int64_t t = first; t < last; ++t) {
      const int64_t n0 = t * LANES, valid = std::min<int64_t>(LANES, out_features - n0);
      for (int64_t i = 0; i < count; i += 4) {  // four rows at a time: more spill the registers (measured)
        const int rows_here = static_cast<int>(std::min<int64_t>(4, count - i));
        switch (rows_here) {
          case 1: int8_tile<1, Q4>(vnni, w, xq, i, t, block); break;
          case 2: int8_tile<2, Q4>(vnni, w, xq, i, t, block); break;
          case 3: int8_tile<3, Q4>(vnni, w, xq, i, t, block); break;
          default: int8_tile<4, Q4>(vnni, w, xq, i, t, block);
        }
        for (int r = 0; r < rows_here; ++r)
          for (int64_t f = 0; f < valid; ++f)
            os[(i + r) * out_features + n0 + f] = bs ? block[r][f] + bs[n0 + f] : block[r][f];
      }
    }
  });
  return out.view(shape);
}

void check_repacked(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, int64_t chunk_bytes,
                    int64_t out_features) {
  const int64_t in = x.size(-1), groups = in / GROUP, tiles = (out_features + LANES - 1) / LANES;
  TORCH_CHECK(in % GROUP == 0, "int8 linear layers need in_features divisible by ", GROUP, ", got ", in);
  TORCH_CHECK(codes.is_contiguous() && codes.numel() == tiles * groups * chunk_bytes,
              "codes must be contiguous, repacked for ", out_features, " x ", in, " (engine/model/quant.py repack)");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() &&
                  scales.sizes() == at::IntArrayRef({tiles, groups, LANES}),
              "scales must be contiguous float16 [tiles, in_features / 32, 16]");
}

at::Tensor q4_1_int8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                            const at::Tensor& mins, const std::optional<at::Tensor>& bias, int64_t out_features) {
  TORCH_CHECK(codes.scalar_type() == at::kByte, "Q4_1 codes are uint8");
  check_repacked(x, codes, scales, 256, out_features);
  TORCH_CHECK(mins.sizes() == scales.sizes() && mins.is_contiguous() && mins.scalar_type() == at::kHalf,
              "mins must match scales");
  const Int8Layer w{codes.data_ptr<uint8_t>(), scales.data_ptr<at::Half>(), mins.data_ptr<at::Half>(),
                    x.size(-1) / GROUP};
  return int8_linear<true>(x, w, out_features, bias);
}

at::Tensor q8_0_int8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                            const std::optional<at::Tensor>& bias, int64_t out_features) {
  TORCH_CHECK(codes.scalar_type() == at::kChar, "Q8_0 codes are int8");
  check_repacked(x, codes, scales, 512, out_features);
  const Int8Layer w{reinterpret_cast<const uint8_t*>(codes.data_ptr<int8_t>()), scales.data_ptr<at::Half>(), nullptr,
                    x.size(-1) / GROUP};
  return int8_linear<false>(x, w, out_features, bias);
}

// exp(x) for x <= 0 (Cody-Waite range reduction and a degree-6 polynomial, ~1 ulp): one function for every score.
// Its constants, shared by the 8- and 16-lane versions so that the two cannot drift apart.
struct ExpConstants {
  static constexpr float lowest = -87.f, log2e = 1.44269504088896341f, ln2_high = 0.693359375f,
                         ln2_low = -2.12194440e-4f;
  static constexpr float poly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                                    4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
};

__m256 exp_nonpositive(__m256 x) {
  using C = ExpConstants;
  x = _mm256_max_ps(x, _mm256_set1_ps(C::lowest));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(C::log2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(C::ln2_high), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(C::ln2_low), r);
  __m256 p = _mm256_set1_ps(C::poly[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(C::poly[i]));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

WIDE __m512 exp_nonpositive_wide(__m512 x) {  // exp_nonpositive on 16 lanes, lane for lane the same operations
  using C = ExpConstants;
  x = _mm512_max_ps(x, _mm512_set1_ps(C::lowest));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(C::log2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(C::ln2_high), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(C::ln2_low), r);
  __m512 p = _mm512_set1_ps(C::poly[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(C::poly[i]));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

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

// The keys one query row sees, in key order, with their additive mask values: the same for every head of the row.
struct Visible {
  std::vector<int64_t> keys;
  std::vector<float> bias;
  int64_t count() const { return static_cast<int64_t>(keys.size()); }
};

// The visible keys of each (batch, row), flattened b * rows + i, of a mask as attention() takes it: additive float
// [1 or B, 1, M, >= L], a key hidden where it is -FLT_MAX or below; absent: causal, the M queries being the last M of
// the L positions. One scan serves every layer of a forward.
std::vector<Visible> visible_rows(const std::optional<at::Tensor>& mask, int64_t batch, int64_t rows, int64_t length) {
  std::vector<Visible> visible(batch * rows);
  if (!mask.has_value()) {
    for (int64_t r = 0; r < batch * rows; ++r) {
      Visible& seen = visible[r];
      seen.keys.resize(length - rows + r % rows + 1);
      std::iota(seen.keys.begin(), seen.keys.end(), 0);
      seen.bias.assign(seen.keys.size(), 0.f);
    }
    return visible;
  }
  TORCH_CHECK(mask->scalar_type() == at::kFloat && mask->dim() == 4 && mask->size(1) == 1 &&
                  (mask->size(0) == 1 || mask->size(0) == batch) && mask->size(2) == rows &&
                  mask->size(3) >= length && mask->stride(3) == 1,
              "attention: the mask must be float32 [1 or B, 1, M, >= L] with a contiguous last dimension");
  const float* bias = mask->data_ptr<float>();
  const int64_t bias_batch = mask->size(0) == 1 ? 0 : mask->stride(0), bias_row = mask->stride(2);
  for (int64_t r = 0; r < batch * rows; ++r) {
    const float* row = bias + r / rows * bias_batch + r % rows * bias_row;
    Visible& seen = visible[r];
    seen.keys.resize(std::count_if(row, row + length, [](float b) { return b > -FLT_MAX; }));  // no regrowing
    seen.bias.resize(seen.keys.size());
    for (int64_t j = 0, n = 0; j < length; ++j)
      if (row[j] > -FLT_MAX) seen.keys[n] = j, seen.bias[n++] = row[j];
  }
  return visible;
}

// Ask for `bytes` from p on into L1 ahead of use (one row of a call does, for the rows after it): keys and values
// stream from memory faster than the hardware prefetcher alone fetches them.
inline void prefetch(const void* p, int64_t bytes) {
  for (int64_t c = 0; c < bytes; c += 64) _mm_prefetch(reinterpret_cast<const char*>(p) + c, _MM_HINT_T0);
}

// Score = hsum of one 8-lane accumulator over the head dimension in order, * scale + mask, for Q query heads that
// share a key/value head, over `count` of a row's visible keys (four keys side by side: 4 Q independent FMA chains,
// their hsums four at a time; the last count % 4 one at a time). A key's score is the same sequence whichever of
// the two ways it takes, and which one depends only on its place among the row's visible keys.
template <int Q, typename T>
void score_keys(const Heads<T>& k, int64_t b, int64_t g, int64_t dim, const int64_t* keys, const float* masks,
                int64_t count, const float* const* queries, float scale, float* const* weights, bool fetch) {
  int64_t j = 0;
  for (; j + 4 <= count; j += 4) {
    const T* key[4];
    for (int t = 0; t < 4; ++t) key[t] = k.at(b, g, keys[j + t]);
    if (fetch && j + 32 < count) prefetch(k.at(b, g, keys[j + 32]), 4 * dim * sizeof(T));
    __m256 acc[Q][4];
    for (int h = 0; h < Q; ++h)
      for (int t = 0; t < 4; ++t) acc[h][t] = _mm256_setzero_ps();
    for (int64_t d = 0; d < dim; d += 8)
      for (int h = 0; h < Q; ++h) {
        const __m256 qv = _mm256_loadu_ps(queries[h] + d);
        for (int t = 0; t < 4; ++t) acc[h][t] = _mm256_fmadd_ps(qv, load8(key[t] + d), acc[h][t]);
      }
    const __m128 bias = _mm_loadu_ps(masks + j);
    for (int h = 0; h < Q; ++h) {
      const __m128 sums = hsum4(acc[h][0], acc[h][1], acc[h][2], acc[h][3]);
      _mm_storeu_ps(weights[h] + j, _mm_add_ps(_mm_mul_ps(sums, _mm_set1_ps(scale)), bias));
    }
  }
  for (; j < count; ++j) {
    const T* key = k.at(b, g, keys[j]);
    for (int h = 0; h < Q; ++h) {
      __m256 acc = _mm256_setzero_ps();
      for (int64_t d = 0; d < dim; d += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(queries[h] + d), load8(key + d), acc);
      weights[h][j] = hsum(acc) * scale + masks[j];
    }
  }
}

// score_keys on AVX-512, eight keys at a time: one 16-lane vector holds the 8-lane accumulators of keys t and t + 4
// side by side, each making the very operations of the 8-lane path; the rest of the keys go to score_keys.
template <int Q, typename T>
WIDE void score_keys_wide(const Heads<T>& k, int64_t b, int64_t g, int64_t dim, const int64_t* keys, const float* masks,
                          int64_t count, const float* const* queries, float scale, float* const* weights,
                          bool fetch) {
  int64_t j = 0;
  for (; j + 8 <= count; j += 8) {
    const T* key[8];
    for (int t = 0; t < 8; ++t) key[t] = k.at(b, g, keys[j + t]);
    if (fetch && j + 32 < count) prefetch(k.at(b, g, keys[j + 32]), 8 * dim * sizeof(T));
    __m512 acc[Q][4];
    for (int h = 0; h < Q; ++h)
      for (int t = 0; t < 4; ++t) acc[h][t] = _mm512_setzero_ps();
    for (int64_t d = 0; d < dim; d += 8) {
      __m512 pairs[4];
      for (int t = 0; t < 4; ++t)
        pairs[t] = _mm512_insertf32x8(_mm512_castps256_ps512(load8(key[t] + d)), load8(key[t + 4] + d), 1);
      for (int h = 0; h < Q; ++h) {
        const __m512 qv = _mm512_broadcast_f32x8(_mm256_loadu_ps(queries[h] + d));
        for (int t = 0; t < 4; ++t) acc[h][t] = _mm512_fmadd_ps(qv, pairs[t], acc[h][t]);
      }
    }
    for (int half = 0; half < 2; ++half) {
      const __m128 bias = _mm_loadu_ps(masks + j + 4 * half);
      for (int h = 0; h < Q; ++h) {
        __m256 a[4];
        for (int t = 0; t < 4; ++t)
          a[t] = half ? _mm512_extractf32x8_ps(acc[h][t], 1) : _mm512_castps512_ps256(acc[h][t]);
        const __m128 sums = hsum4(a[0], a[1], a[2], a[3]);
        _mm_storeu_ps(weights[h] + j + 4 * half, _mm_add_ps(_mm_mul_ps(sums, _mm_set1_ps(scale)), bias));
      }
    }
  }
  float* rest[3];
  for (int h = 0; h < Q; ++h) rest[h] = weights[h] + j;
  score_keys<Q, T>(k, b, g, dim, keys + j, masks + j, count - j, queries, scale, rest, fetch);
}

// exp(score - most) in place for keys from .. count of one query, its 8-lane blocks added to total in key order.
__m256 exponentiate_from(float* w, int64_t from, int64_t count, float most, __m256 total) {
  for (int64_t i = from; i < count; i += 8) {
    const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(w + i), _mm256_set1_ps(most)));
    const __m256 live = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(count - i)),
                                                               _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
    const __m256 kept = _mm256_and_ps(e, live);  // the padding past the last key weighs nothing
    _mm256_storeu_ps(w + i, kept);
    total = _mm256_add_ps(total, kept);
  }
  return total;
}

// One query's scores become exp(score - their largest) in place; returns their sum (8-lane blocks in key order,
// hsum). w has room for count rounded up to 8.
float exponentiate(float* w, int64_t count) {
  const float most = *std::max_element(w, w + count);
  return hsum(exponentiate_from(w, 0, count, most, _mm256_setzero_ps()));
}

WIDE float exponentiate_wide(float* w, int64_t count) {  // the same on 16 lanes, the sum still 8-lane blocks in order
  __m512 top = _mm512_set1_ps(-FLT_MAX);
  int64_t i = 0;
  for (; i + 16 <= count; i += 16) top = _mm512_max_ps(top, _mm512_loadu_ps(w + i));
  float most = _mm512_reduce_max_ps(top);
  for (; i < count; ++i) most = std::max(most, w[i]);
  __m256 total = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 16 <= count; j += 16) {
    const __m512 e = exp_nonpositive_wide(_mm512_sub_ps(_mm512_loadu_ps(w + j), _mm512_set1_ps(most)));
    _mm512_storeu_ps(w + j, e);
    total = _mm256_add_ps(_mm256_add_ps(total, _mm512_castps512_ps256(e)), _mm512_extractf32x8_ps(e, 1));
  }
  return hsum(exponentiate_from(w, j, count, most, total));
}

// Output dimensions d0 .. d0 + 8 WIDTH of Q query heads: the sum over the row's visible keys in order of weight *
// value, then / the weights' sum (Q * WIDTH accumulators in registers).
template <int Q, int WIDTH, typename T>
void mix_values(const Heads<T>& v, int64_t b, int64_t g, const Visible& seen, const float* const* weights,
                const float* totals, int64_t d0, float* const* outs, bool fetch) {
  const int64_t* keys = seen.keys.data();
  const int64_t count = seen.count();
  __m256 acc[Q][WIDTH];
  for (int h = 0; h < Q; ++h)
    for (int x = 0; x < WIDTH; ++x) acc[h][x] = _mm256_setzero_ps();
  for (int64_t i = 0; i < count; ++i) {
    const T* value = v.at(b, g, keys[i]) + d0;
    if (fetch && i + 32 < count) prefetch(v.at(b, g, keys[i + 32]) + d0, 8 * WIDTH * sizeof(T));
    for (int x = 0; x < WIDTH; ++x) {
      const __m256 vx = load8(value + 8 * x);
      for (int h = 0; h < Q; ++h) acc[h][x] = _mm256_fmadd_ps(_mm256_set1_ps(weights[h][i]), vx, acc[h][x]);
    }
  }
  for (int h = 0; h < Q; ++h)
    for (int x = 0; x < WIDTH; ++x)
      _mm256_storeu_ps(outs[h] + d0 + 8 * x, _mm256_div_ps(acc[h][x], _mm256_set1_ps(totals[h])));
}

// mix_values on AVX-512: 16 output dimensions a vector, each lane the same sequence (WIDTH even).
template <int Q, int WIDTH, typename T>
WIDE void mix_values_wide(const Heads<T>& v, int64_t b, int64_t g, const Visible& seen, const float* const* weights,
                          const float* totals, int64_t d0, float* const* outs, bool fetch) {
  constexpr int VECTORS = WIDTH / 2;
  const int64_t* keys = seen.keys.data();
  const int64_t count = seen.count();
  __m512 acc[Q][VECTORS];
  for (int h = 0; h < Q; ++h)
    for (int x = 0; x < VECTORS; ++x) acc[h][x] = _mm512_setzero_ps();
  for (int64_t i = 0; i < count; ++i) {
    const T* value = v.at(b, g, keys[i]) + d0;
    if (fetch && i + 32 < count) prefetch(v.at(b, g, keys[i + 32]) + d0, 8 * WIDTH * sizeof(T));
    for (int x = 0; x < VECTORS; ++x) {
      const __m512 vx = load16(value + 16 * x);
      for (int h = 0; h < Q; ++h) acc[h][x] = _mm512_fmadd_ps(_mm512_set1_ps(weights[h][i]), vx, acc[h][x]);
    }
  }
  for (int h = 0; h < Q; ++h)
    for (int x = 0; x < VECTORS; ++x)
      _mm512_storeu_ps(outs[h] + d0 + 16 * x, _mm512_div_ps(acc[h][x], _mm512_set1_ps(totals[h])));
}

// f(std::integral_constant<int, n>) for n = 1, 2 or 3 query heads side by side: the kernels' template argument.
template <typename F>
void with_heads(int64_t n, F f) {
  if (n == 3) f(std::integral_constant<int, 3>{});
  else if (n == 2) f(std::integral_constant<int, 2>{});
  else f(std::integral_constant<int, 1>{});
}

// One block of query rows of an attention call. Its three passes (scores, softmax, value sums) each split into
// tasks that keep both threads busy whatever the rows: a key/value head's keys in stretches, (row, head) pairs,
// a key/value head's output dimensions in slices; in the first and last every row of the block goes through the
// stretch or slice in turn, so a key or value the rows share is read from memory once for all of them (a tree's
// nodes share the whole context). No pass changes any query's sequence of operations, so the bits stay a function
// of the row's visible keys alone.
template <typename T>
struct Block {
  const Heads<float>& q;
  const Heads<T>&k, &v;
  const std::vector<Visible>& visible;
  int64_t rows, heads, kv_heads, dim;  // rows: of each batch entry, to find a flattened row's batch entry
  int64_t first, last;                 // flattened rows
  float scale;
  float* out;                          // [B * M, heads, dim]
  int64_t padded;                      // room per (row, head) in weights: the longest visible count, to a multiple of 8
  std::unique_ptr<float[]> weights;    // [rows of the block, heads, padded], written before it is read
  std::vector<float> totals;           // [rows of the block, heads]
  bool wide = use_wide;                // the AVX-512 path, with the same bits

  int64_t together() const { return std::min<int64_t>(heads / kv_heads, 3); }  // query heads handled side by side
  int64_t parts() const { return (heads / kv_heads + together() - 1) / together(); }
  float* weights_of(int64_t r, int64_t h) { return weights.get() + ((r - first) * heads + h) * padded; }

  // body(h0, n, queries, weights, outs) for the n query heads from h0 on of part `part` of key/value head g, row r
  template <typename Body>
  void heads_of_part(int64_t r, int64_t g, int64_t part, Body body) {
    const int64_t h0 = g * (heads / kv_heads) + part * together();
    const int64_t n = std::min(together(), (g + 1) * (heads / kv_heads) - h0);
    const float* queries[3];
    float* ws[3];
    float* outs[3];
    for (int64_t h = 0; h < n; ++h) {
      queries[h] = q.at(r / rows, h0 + h, r % rows);
      ws[h] = weights_of(r, h0 + h);
      outs[h] = out + (r * heads + h0 + h) * dim;
    }
    body(h0, n, queries, ws, outs);
  }

  void score(int64_t stretch) {
    int64_t longest = 0;
    for (int64_t r = first; r < last; ++r) longest = std::max(longest, visible[r].count());
    const int64_t stretches = std::max<int64_t>(1, (longest + stretch - 1) / stretch);
    const int64_t length = (longest + stretches - 1) / stretches / 8 * 8 + 8;  // a multiple of 4: see score_keys
    at::parallel_for(0, kv_heads * parts() * stretches, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t task = t0; task < t1; ++task) {
        const int64_t s = task % stretches, part = task / stretches % parts(), g = task / stretches / parts();
        for (int64_t r = first; r < last; ++r) {
          const Visible& seen = visible[r];
          const int64_t from = s * length, to = std::min(seen.count(), from + length);
          if (from >= to) continue;
          heads_of_part(r, g, part, [&](int64_t, int64_t n, const float* const* queries, float* const* ws, float**) {
            float* at[3];
            for (int64_t h = 0; h < n; ++h) at[h] = ws[h] + from;
            const int64_t b = r / rows, *keys = seen.keys.data() + from, count = to - from;
            const float* masks = seen.bias.data() + from;
            with_heads(n, [&](auto q_heads) {
              constexpr int Q = decltype(q_heads)::value;
              (wide ? score_keys_wide<Q, T> : score_keys<Q, T>)(k, b, g, dim, keys, masks, count, queries, scale,
                                                               at, r == first);
            });
          });
        }
      }
    });
  }

  void softmax() {
    at::parallel_for(0, (last - first) * heads, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t task = t0; task < t1; ++task) {
        const int64_t r = first + task / heads, h = task % heads;
        if (visible[r].count() > 0)
          totals[task] = (wide ? exponentiate_wide : exponentiate)(weights_of(r, h), visible[r].count());
      }
    });
  }

  template <int WIDTH>
  void mix() {
    const int64_t slices = dim / (8 * WIDTH);
    at::parallel_for(0, kv_heads * parts() * slices, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t task = t0; task < t1; ++task) {
        const int64_t d0 = task % slices * 8 * WIDTH, part = task / slices % parts(), g = task / slices / parts();
        for (int64_t r = first; r < last; ++r)
          heads_of_part(r, g, part, [&](int64_t h0, int64_t n, const float* const*, float* const* ws, float** outs) {
            const Visible& seen = visible[r];
            if (seen.count() == 0) {  // a row that sees no key gets zeros
              for (int64_t h = 0; h < n; ++h) std::fill(outs[h] + d0, outs[h] + d0 + 8 * WIDTH, 0.f);
              return;
            }
            const float* sums = totals.data() + (r - first) * heads + h0;
            const int64_t b = r / rows;
            with_heads(n, [&](auto q_heads) {
              constexpr int Q = decltype(q_heads)::value;
              (wide && WIDTH % 2 == 0 ? mix_values_wide<Q, WIDTH, T> : mix_values<Q, WIDTH, T>)(
                  v, b, g, seen, ws, sums, d0, outs, r == first);
            });
          });
      }
    });
  }
};

constexpr int64_t STRETCH = 256;               // keys per scoring task, at most
constexpr int64_t BLOCK_WEIGHTS = 1 << 19;    // floats of scores a block of rows holds, at most (prefill)

// query [B, H, M, D], key/value [B, Hkv, L, D] (views of a longer cache are fine), the visible keys of each
// (batch, row) (visible_rows). Returns [B, M, H, D].
template <typename T>
at::Tensor attend_as(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                     const std::vector<Visible>& visible, double scale) {
  const Heads<float> q = heads_of<float>(query);
  const Heads<T> k = heads_of<T>(key), v = heads_of<T>(value);
  const int64_t batch = query.size(0), heads = query.size(1), rows = query.size(2), dim = query.size(3);
  const int64_t kv_heads = key.size(1);
  TORCH_CHECK(dim % 8 == 0, "attention needs a head_dim divisible by 8, got ", dim);
  TORCH_CHECK(heads % kv_heads == 0 && value.sizes() == key.sizes() && key.size(0) == batch && key.size(3) == dim,
              "attention: query [B, H, M, D] and key/value [B, Hkv, L, D] with H a multiple of Hkv");
  TORCH_CHECK(static_cast<int64_t>(visible.size()) == batch * rows, "attention: visible keys for ", visible.size(),
              " rows, not ", batch * rows);
  at::Tensor out = at::empty({batch, rows, heads, dim}, query.options());
  int64_t longest = 0;
  for (const Visible& seen : visible) longest = std::max(longest, seen.count());
  const int64_t padded = std::max<int64_t>(8, (longest + 7) / 8 * 8);
  const int64_t per_block = std::max<int64_t>(1, BLOCK_WEIGHTS / (heads * padded));
  for (int64_t first = 0; first < batch * rows; first += per_block) {
    const int64_t last = std::min(batch * rows, first + per_block);
    Block<T> block{q, k, v, visible, rows, heads, kv_heads, dim, first, last, static_cast<float>(scale),
                out.data_ptr<float>(), padded, std::unique_ptr<float[]>(new float[(last - first) * heads * padded]),
                std::vector<float>((last - first) * heads)};
    block.score(STRETCH);
    block.softmax();
    if (dim % 32 == 0) block.template mix<4>();
    else block.template mix<1>();
  }
  return out;
}

// attend_as for float32 or float16 keys and values (both of one dtype).
at::Tensor attend(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                  const std::vector<Visible>& visible, double scale) {
  TORCH_CHECK(value.scalar_type() == key.scalar_type(), "attention: keys and values of one dtype");
  return key.scalar_type() == at::kHalf ? attend_as<at::Half>(query, key, value, visible, scale)
                                        : attend_as<float>(query, key, value, visible, scale);
}

// query [B, H, M, D], key/value [B, Hkv, L, D] (views of a longer cache are fine), mask additive float [Bm, 1, M, >=L]
// (a key is hidden where it is -FLT_MAX or below) or absent (causal, the M queries being the last M positions).
// Returns [B, M, H, D].
at::Tensor attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                     const std::optional<at::Tensor>& mask, double scale) {
  return attend(query, key, value, visible_rows(mask, query.size(0), query.size(2), key.size(2)), scale);
}

int64_t ceil_log2(int64_t x) { return x <= 2 ? 1 : 64 - __builtin_clzll(static_cast<uint64_t>(x - 1)); }

// torch's sum of a contiguous float32 row (ATen's SumKernel.cpp, its inner-dimension cascade sum): vectors of `lanes`
// floats taken four side by side and added in chunks of 16 that are summed level by level, the four partial vectors
// then added in order, then the lanes one by one after the scalar tail, onto the zero the output starts as. The
// same additions lane by lane, so the same bits, without the ~2 us of a TensorIterator per call (rms_norm's mean,
// twice a layer).
float torch_row_sum(const float* x, int64_t width, int64_t lanes) {
  if (width < lanes) lanes = 1;  // torch sums a row shorter than a vector as scalars, by the same cascade
  constexpr int64_t LEVELS = 4, ILP = 4;
  const int64_t vectors = width / lanes, rows = vectors / ILP;
  const int64_t power = std::max<int64_t>(4, ceil_log2(rows) / LEVELS), step = int64_t(1) << power;
  float acc[LEVELS][ILP][16] = {};
  const auto add_row = [&](int64_t i) {
    for (int64_t k = 0; k < ILP; ++k)
      for (int64_t l = 0; l < lanes; ++l) acc[0][k][l] += x[(i * ILP + k) * lanes + l];
  };
  int64_t i = 0;
  while (i + step <= rows) {
    for (int64_t j = 0; j < step; ++j, ++i) add_row(i);
    for (int64_t level = 1; level < LEVELS; ++level) {
      for (int64_t k = 0; k < ILP; ++k)
        for (int64_t l = 0; l < lanes; ++l) acc[level][k][l] += acc[level - 1][k][l], acc[level - 1][k][l] = 0.f;
      if ((i & ((step - 1) << (level * power))) != 0) break;
    }
  }
  for (; i < rows; ++i) add_row(i);
  for (int64_t level = 1; level < LEVELS; ++level)
    for (int64_t k = 0; k < ILP; ++k)
      for (int64_t l = 0; l < lanes; ++l) acc[0][k][l] += acc[level][k][l];
  for (int64_t v = rows * ILP; v < vectors; ++v)
    for (int64_t l = 0; l < lanes; ++l) acc[0][0][l] += x[v * lanes + l];
  for (int64_t k = 1; k < ILP; ++k)
    for (int64_t l = 0; l < lanes; ++l) acc[0][0][l] += acc[0][k][l];
  float total = 0.f;
  for (int64_t e = vectors * lanes; e < width; ++e) total += x[e];
  for (int64_t l = 0; l < lanes; ++l) total += acc[0][0][l];
  return 0.f + total;
}

// The lanes with which torch sums a float32 row here (torch_row_sum): 8 on AVX2 CPUs, and on AVX-512 ones too where
// torch dispatches its sum to AVX2 code (2.13 does), found once by comparing with at::sum on fixed rows of several
// widths; 0 if neither 8 nor 16 gives its bits (another torch), and rms_norm then calls torch's mean.
int64_t torch_sum_lanes() {
  static const int64_t found = [] {
    for (const int64_t lanes : {8, 16}) {
      bool same = true;
      for (const int64_t width : {7, 64, 576, 1536, 5000, 30000}) {
        std::vector<float> row(width);
        for (int64_t j = 0; j < width; ++j) row[j] = static_cast<float>((j * 2654435761u) % 10007) / 97.f + 1e-3f;
        const float theirs = at::from_blob(row.data(), {width}, at::kFloat).sum().item<float>();
        same = same && torch_row_sum(row.data(), width, lanes) == theirs;
      }
      if (same) return lanes;
    }
    return int64_t(0);
  }();
  return found;
}

// transformers' LlamaRMSNorm, w * (x * rsqrt(mean(x^2) + eps)), each step rounded as torch rounds it: the mean is
// torch's sum / width, as torch's CPU mean computes it (by hand where torch_sum_lanes knows torch's order, else
// torch's own); pow(x, 2) is x * x and rsqrt is 1 / sqrt in torch too.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat && weight.is_contiguous(),
              "rms_norm takes float32 inputs and weights");
  const at::Tensor in = x.contiguous();
  const int64_t width = in.size(-1), rows = in.numel() / width;
  TORCH_CHECK(weight.numel() == width, "rms_norm: ", weight.numel(), " weights for rows of ", width);
  at::Tensor out = at::empty_like(in);
  std::vector<float> squares(width);
  const float *xs = in.data_ptr<float>(), *w = weight.data_ptr<float>(), e = static_cast<float>(eps);
  float* os = out.data_ptr<float>();
  const int64_t lanes = torch_sum_lanes();
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = xs + r * width;
    for (int64_t j = 0; j < width; ++j) squares[j] = row[j] * row[j];
    const float mean = lanes > 0 ? torch_row_sum(squares.data(), width, lanes) / static_cast<float>(width)
                                 : at::from_blob(squares.data(), {width}, at::kFloat).mean().item<float>();
    const float scale = 1.f / std::sqrt(mean + e);
    for (int64_t j = 0; j < width; ++j) os[r * width + j] = w[j] * (row[j] * scale);
  }
  return out;
}

// A float32 result as a cache of type T keeps it: itself, or float16 rounded to nearest even as torch's copy_ rounds.
inline void store(float* to, float value) { *to = value; }
inline void store(at::Half* to, float value) {
  const uint16_t bits = _cvtss_sh(value, _MM_FROUND_TO_NEAREST_INT);
  std::memcpy(to, &bits, sizeof bits);
}

// The heads a stacked q, k, v matmul's output [1, M, F] holds from feature `from` on, as [1, H, M, head_dim].
Heads<float> heads_in(const at::Tensor& qkv, int64_t from, int64_t head_dim) {
  return {qkv.data_ptr<float>() + from, 0, head_dim, qkv.size(-1)};
}

// A cache buffer [1, Hkv, capacity, D] from position `start` on.
template <typename T>
Heads<T> heads_at(const at::Tensor& buffer, int64_t start) {
  return {buffer.data_ptr<T>() + start * buffer.stride(2), 0, buffer.stride(1), buffer.stride(2)};
}

// transformers' apply_rotary_pos_emb for one of q and k, x * cos + rotate_half(x) * sin with each product rounded
// before the sum as torch rounds them, for `heads` heads of `rows` rows into out (float32, or a float16 cache as
// store rounds). cos, sin: [rows, dim] contiguous.
template <typename T>
void rotate_into(const Heads<float>& x, int64_t heads, int64_t rows, int64_t dim, const float* cos, const float* sin,
                 const Heads<T>& out) {
  const int64_t half = dim / 2;
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t r = 0; r < rows; ++r) {
      const float *in = x.at(0, h, r), *cr = cos + r * dim, *sr = sin + r * dim;
      T* o = out.at(0, h, r);
      for (int64_t d = 0; d < half; ++d) store(o + d, in[d] * cr[d] + -in[d + half] * sr[d]);
      for (int64_t d = half; d < dim; ++d) store(o + d, in[d] * cr[d] + in[d - half] * sr[d]);
    }
}

// The heads of qkv [1, M, F] from feature `from` on, rotated, as a new [1, heads, M, head_dim] tensor.
at::Tensor rotated(const at::Tensor& qkv, int64_t from, int64_t heads, int64_t head_dim, const at::Tensor& cos,
                   const at::Tensor& sin) {
  const int64_t rows = qkv.size(1);
  TORCH_CHECK(qkv.is_contiguous() && cos.is_contiguous() && sin.is_contiguous() && cos.numel() == rows * head_dim,
              "rotary: a contiguous matmul output and cos, sin of [rows, head_dim]");
  at::Tensor out = at::empty({1, heads, rows, head_dim}, qkv.options());
  rotate_into(heads_in(qkv, from, head_dim), heads, rows, head_dim, cos.data_ptr<float>(), sin.data_ptr<float>(),
              heads_of<float>(out));
  return out;
}

// A layer's new keys (rotated) and values from qkv [1, M, F] (from feature qf on) into its cache buffers at `start`.
void write_keys_values(const at::Tensor& qkv, int64_t qf, int64_t head_dim, const at::Tensor& cos,
                       const at::Tensor& sin, const at::Tensor& keys, const at::Tensor& values, int64_t start) {
  const int64_t kv_heads = keys.size(1), rows = qkv.size(1);
  TORCH_CHECK(qkv.is_contiguous() && cos.is_contiguous() && sin.is_contiguous() && cos.numel() == rows * head_dim &&
                  keys.stride(3) == 1 && values.stride(3) == 1 && keys.size(2) >= start + rows &&
                  values.sizes() == keys.sizes(),
              "write_keys_values: a contiguous matmul output, cos and sin [rows, head_dim], buffers with room");
  const auto write = [&](auto element) {
    using T = decltype(element);
    rotate_into(heads_in(qkv, qf, head_dim), kv_heads, rows, head_dim, cos.data_ptr<float>(), sin.data_ptr<float>(),
                heads_at<T>(keys, start));
    const Heads<float> from = heads_in(qkv, qf + kv_heads * head_dim, head_dim);
    const Heads<T> to = heads_at<T>(values, start);
    for (int64_t h = 0; h < kv_heads; ++h)
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t d = 0; d < head_dim; ++d) store(to.at(0, h, r) + d, from.at(0, h, r)[d]);
  };
  if (keys.scalar_type() == at::kHalf) write(at::Half());
  else write(0.f);
}

// Features [from, from + width) of a stacked q, k, v matmul's output [1, M, F] as heads [1, H, M, head_dim] (a view).
at::Tensor split_heads(const at::Tensor& qkv, int64_t from, int64_t width, int64_t head_dim) {
  return qkv.narrow(-1, from, width).view({1, qkv.size(1), -1, head_dim}).transpose(1, 2);
}

// h += y, in place (the residual stream: h + y is y + h, the same rounding either way).
void add_into(at::Tensor& h, const at::Tensor& y) {
  TORCH_CHECK(h.is_contiguous() && y.sizes() == h.sizes(), "add_into: a contiguous h and a y of its shape");
  const at::Tensor ys = y.contiguous();
  float* hs = h.data_ptr<float>();
  const float* add = ys.data_ptr<float>();
  for (int64_t i = 0; i < h.numel(); ++i) hs[i] += add[i];
}

// transformers' LlamaMLP's act_fn(gate) * up from the stacked gate and up outputs [.., 2 * inner]: torch's own SiLU
// (its exp), the product by hand.
at::Tensor gated(const at::Tensor& gate_up) {
  const int64_t inner = gate_up.size(-1) / 2, rows = gate_up.numel() / gate_up.size(-1);
  at::Tensor act = at::silu(gate_up.narrow(-1, 0, inner)).contiguous();
  const float* up = gate_up.data_ptr<float>() + inner;
  float* a = act.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < inner; ++j) a[r * inner + j] *= up[r * 2 * inner + j];
  return act;
}

// A model's weight tensors, handed to the kernels once (engine.model.fused) rather than as a list of hundreds with every
// call: converting that list took ~0.1 ms a forward.
struct Weights : torch::CustomClassHolder {
  std::vector<at::Tensor> tensors;
  explicit Weights(std::vector<at::Tensor> held) : tensors(std::move(held)) {}
};

// Two norms; codes, scales, mins of q, k and v stacked (one matmul), o, gate and up stacked, down.
constexpr int64_t LAYER_TENSORS = 2 + 4 * 3;

// transformers' LlamaModel after the embedding and the rotary tables (its decoder layers and final norm) over M new
// tokens, op for op as transformers runs them on the engine's kernels (Q4_1 linear layers, fixed-order attention),
// so that every output has the very same bits, without Python between the ~40 ops of a layer.
// embeddings [1, M, E]; cos, sin [1, M, head_dim]; mask as attention() takes it (absent: causal); weights: per
// layer LAYER_TENSORS tensors (input norm, post-attention norm, then the groups of each matmul); caches: per
// layer key and value buffers [1, Hkv, capacity, head_dim] (float32 or float16) with room for start + M positions,
// written at start.
// Returns the final-norm hidden states [1, M, E], then the inputs of the layers listed in `capture`, in its order.
std::vector<at::Tensor> llama_forward(const at::Tensor& embeddings, const at::Tensor& cos, const at::Tensor& sin,
                                      const std::optional<at::Tensor>& mask, const c10::intrusive_ptr<Weights>& held,
                                      at::TensorList caches, const at::Tensor& final_norm, int64_t start,
                                      int64_t head_dim, double eps, double scale, at::IntArrayRef capture,
                                      bool int8) {
  const std::vector<at::Tensor>& weights = held->tensors;
  const int64_t layers = static_cast<int64_t>(caches.size()) / 2, rows = embeddings.size(1), end = start + rows;
  TORCH_CHECK(embeddings.dim() == 3 && embeddings.size(0) == 1, "llama_forward takes embeddings [1, M, E]");
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == layers * LAYER_TENSORS,
              "llama_forward: ", LAYER_TENSORS, " weight tensors per layer, got ", weights.size(), " for ", layers);
  for (const at::Tensor& buffer : caches)
    TORCH_CHECK(buffer.dim() == 4 && buffer.size(2) >= end, "llama_forward: a cache buffer holds fewer than ", end,
                " positions");
  std::vector<at::Tensor> out(1 + capture.size());
  at::Tensor h = embeddings.contiguous().clone();  // the residual stream, added to in place
  const at::Tensor cos_rows = cos.contiguous(), sin_rows = sin.contiguous();  // themselves, as the tables come
  const std::vector<Visible> visible = visible_rows(mask, 1, rows, end);  // the same in every layer
  for (int64_t layer = 0; layer < layers; ++layer) {
    for (size_t i = 0; i < capture.size(); ++i)
      if (capture[i] == layer) out[1 + i] = h.clone();
    const at::Tensor* w = weights.data() + layer * LAYER_TENSORS;
    const auto project = [&](int which, const at::Tensor& x) {
      const at::Tensor &codes = w[2 + 3 * which], &scales = w[3 + 3 * which], &mins = w[4 + 3 * which];
      return int8 ? q4_1_int8_linear(x, codes, scales, mins, std::nullopt, scales.size(0) * LANES)
                  : q4_1_linear(x, codes, scales, mins, std::nullopt);
    };
    const at::Tensor &keys = caches[2 * layer], &values = caches[2 * layer + 1];
    const at::Tensor qkv = project(0, rms_norm(h, w[0], eps));  // each feature as q_proj, k_proj or v_proj gives it
    const int64_t kv = keys.size(1) * head_dim, qf = qkv.size(-1) - 2 * kv;
    const at::Tensor q = rotated(qkv, 0, qf / head_dim, head_dim, cos_rows, sin_rows);
    write_keys_values(qkv, qf, head_dim, cos_rows, sin_rows, keys, values, start);
    const at::Tensor attended = attend(q, keys.slice(2, 0, end), values.slice(2, 0, end), visible, scale);
    add_into(h, project(1, attended.reshape({1, rows, -1})));
    add_into(h, project(3, gated(project(2, rms_norm(h, w[1], eps)))));
  }
  for (size_t i = 0; i < capture.size(); ++i)
    TORCH_CHECK(out[1 + i].defined(), "llama_forward: no layer ", capture[i], " to capture");
  out[0] = rms_norm(h, final_norm, eps);
  return out;
}

constexpr int64_t HEAD_TENSORS = 3 + 4 * 2;  // three norms; codes and scales of q, k and v stacked, o, gate and up
                                             // stacked, down

// The EAGLE-3 head's decoder layer (engine/draft/eagle3.py Eagle3Layer with layers.py's Attention and MLP) on Q8_0
// projections, op for op as the Python modules run it, so drafts come out with the same bits, without Python between
// its ~35 ops. embeds and hidden [1, T, H]; cos, sin [T, head_dim]; past keys and values [1, Hkv, S, head_dim] or
// absent; mask bool [1, 1, T, S + T]; weights: input norm, hidden norm, post-attention norm, then the groups of each
// matmul (each output feature computed as in its own projection). Returns the layer's output [1, T, H] and this
// call's keys and values.
std::vector<at::Tensor> eagle3_layer(const at::Tensor& embeds, const at::Tensor& hidden, const at::Tensor& cos,
                                     const at::Tensor& sin, const std::optional<at::Tensor>& past_keys,
                                     const std::optional<at::Tensor>& past_values, const at::Tensor& mask,
                                     at::TensorList weights, int64_t heads, int64_t head_dim, double eps,
                                     bool int8) {
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == HEAD_TENSORS, "eagle3_layer: ", HEAD_TENSORS,
              " weight tensors, got ", weights.size());
  TORCH_CHECK(past_keys.has_value() == past_values.has_value(), "eagle3_layer: past keys without values");
  const int64_t rows = hidden.size(1);
  const auto project = [&](int which, const at::Tensor& x) {
    const at::Tensor &codes = weights[3 + 2 * which], &scales = weights[4 + 2 * which];
    return int8 ? q8_0_int8_linear(x, codes, scales, std::nullopt, scales.size(0) * LANES)
                : q8_0_linear(x, codes, scales, std::nullopt);
  };
  const at::Tensor x = at::cat({rms_norm(embeds, weights[0], eps), rms_norm(hidden, weights[1], eps)}, -1);
  const at::Tensor qkv = project(0, x);
  const int64_t qf = heads * head_dim, kv = (qkv.size(-1) - qf) / 2;
  const at::Tensor cos_rows = cos.contiguous(), sin_rows = sin.contiguous();
  const at::Tensor q = rotated(qkv, 0, qf / head_dim, head_dim, cos_rows, sin_rows);
  const at::Tensor k = rotated(qkv, qf, kv / head_dim, head_dim, cos_rows, sin_rows);
  const at::Tensor v = split_heads(qkv, qf + kv, kv, head_dim);
  const at::Tensor keys = past_keys.has_value() ? at::cat({*past_keys, k}, 2) : k;
  const at::Tensor values = past_values.has_value() ? at::cat({*past_values, v}, 2) : v;
  // layers.attend: query heads sharing a key/value head become rows of one attention, the mask repeated for each.
  const int64_t kv_heads = keys.size(1), groups = heads / kv_heads;
  at::Tensor attended;
  if (groups == 1) {
    attended = at::scaled_dot_product_attention(q, keys, values, mask);
  } else {
    const at::Tensor grouped = q.reshape({1, kv_heads, groups * rows, head_dim});
    const at::Tensor repeated = mask.unsqueeze(2).expand({-1, -1, groups, -1, -1}).flatten(2, 3);
    attended = at::scaled_dot_product_attention(grouped, keys, values, repeated).view({1, heads, rows, head_dim});
  }
  const at::Tensor after = hidden + project(1, attended.transpose(1, 2).reshape({1, rows, -1}));
  return {after + project(3, gated(project(2, rms_norm(after, weights[2], eps)))), k, v};
}

}  // namespace

// Whether the linear layers take the AVX-512 path; returns whether they now do (never on a CPU without it).
bool set_wide(bool wide) {
  use_wide = wide && cpu_has_avx512();
  return use_wide;
}

// Whether the int8 layers take the AVX-512 VNNI path; returns whether they now do (never on a CPU without it).
bool set_vnni(bool vnni) {
  use_vnni = vnni && cpu_has_vnni();
  return use_vnni;
}

TORCH_LIBRARY(eagle_cpu, m) {
  m.def("set_wide(bool wide) -> bool", &set_wide);
  m.def("set_vnni(bool vnni) -> bool", &set_vnni);
  m.def("q4_1_int8_linear(Tensor x, Tensor codes, Tensor scales, Tensor mins, Tensor? bias, int out_features) -> Tensor");
  m.def("q8_0_int8_linear(Tensor x, Tensor codes, Tensor scales, Tensor? bias, int out_features) -> Tensor");
  m.def("q4_1_linear(Tensor x, Tensor codes, Tensor scales, Tensor mins, Tensor? bias) -> Tensor");
  m.def("q8_0_linear(Tensor x, Tensor codes, Tensor scales, Tensor? bias) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("torch_sum_lanes() -> int", &torch_sum_lanes);
  m.def("attention(Tensor query, Tensor key, Tensor value, Tensor? mask, float scale) -> Tensor");
  m.class_<Weights>("Weights").def(torch::init<std::vector<at::Tensor>>());
  m.def("llama_forward(Tensor embeddings, Tensor cos, Tensor sin, Tensor? mask, "
        "__torch__.torch.classes.eagle_cpu.Weights weights, Tensor[] caches, "
        "Tensor final_norm, int start, int head_dim, float eps, float scale, int[] capture, bool int8) -> Tensor[]");
  m.def("eagle3_layer(Tensor embeds, Tensor hidden, Tensor cos, Tensor sin, Tensor? past_keys, Tensor? past_values, "
        "Tensor mask, Tensor[] weights, int heads, int head_dim, float eps, bool int8) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(eagle_cpu, CPU, m) {
  m.impl("q4_1_linear", &q4_1_linear);
  m.impl("q8_0_linear", &q8_0_linear);
  m.impl("q4_1_int8_linear", &q4_1_int8_linear);
  m.impl("q8_0_int8_linear", &q8_0_int8_linear);
  m.impl("rms_norm", &rms_norm);
  m.impl("attention", &attention);
  m.impl("llama_forward", &llama_forward);
  m.impl("eagle3_layer", &eagle3_layer);
}
