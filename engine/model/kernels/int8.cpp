// int8 activations (kernels="int8"): llama.cpp's kind of arithmetic on a GGUF's own groups, for every type the
// engine reads (engine/model/quant.py: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K).
//
// Each input row is rounded on its own, group by group: d = max|x| / 127, q = x / d rounded to nearest even, s =
// sum(q). A group's dot product with a weight group is then an integer sum, exact on any path in any order, and only
// its scaling is float, one fixed sequence per output feature, group after group:
//   acc = acc + float(sum(qw * q)) * (dw * d)      with mins: mins = mins + mw * (d * float(s))
// (a type with a scale per 16 weights, Q6_K, takes the two halves' sums one after the other, each with its own dw),
// then out = acc (+ mins) (+ bias). Every type is one of two code layouts: 4-bit codes 0..15 (Q4_0, Q4_1, Q4_K) or
// 8-bit signed codes (Q8_0, and the 5- and 6-bit types, whose codes fit a byte), with a float16 or float32 scale per
// group (float32 where GGUF's scale times a sub-block scale is not a float16), and a min per group where the type has
// one. The weights are repacked at load (engine/model/quant.py repack) so that a vector lane is an output feature: 16
// features a tile, for each group 8 chunks of 4 consecutive weights of every feature, 64 bytes a chunk (4-bit:
// chunks c and c + 4 in one byte's low and high nibbles, as GGUF pairs weights j and j + 16); scales and mins
// [tile, group, 16] ([tile, group, 2, 16] for two scales a group). One instruction multiplies 4 weights of 16
// features by 4 activations broadcast: with AVX-512 VNNI (vpdpbusd) 64 products, with AVX2 two instructions for 8
// features; either way the integers are exact and the float steps are lane for lane the same, so both paths give
// the same bits, and a row's result never depends on the rows beside it.
#include "kernels.h"

#include <algorithm>
#include <numeric>

namespace eagle_cpu {
namespace {

struct Int8Rows {
  std::vector<int8_t> q;   // [rows, in]
  std::vector<float> d;    // [rows, in / 32]
  std::vector<float> ds;   // d * float(s)
  std::vector<int32_t> s;  // sum of a group's q, then of its two halves: [rows, in / 32, 3]
};

// Eight lanes at a time, with the scalar definition's every result: max|x| is exact in any order (a NaN lane keeps
// the running max, as std::max(most, NaN) does), each q is x * inverse rounded in the current (nearest-even) mode and
// truncated, its low byte stored as a cast keeps it, and the integer sum wraps alike in any order.
Int8Rows quantize_rows(const float* x, int64_t rows, int64_t in) {
  const int64_t groups = rows * (in / GROUP);
  Int8Rows r;
  r.q.resize(rows * in), r.d.resize(groups), r.ds.resize(groups), r.s.resize(3 * groups);
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
    __m256i sums[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
    for (int k = 0; k < GROUP / 8; ++k) {
      const __m256 scaled = _mm256_mul_ps(v[k], _mm256_set1_ps(inverse));
      const __m256i q = _mm256_cvttps_epi32(_mm256_round_ps(scaled, _MM_FROUND_CUR_DIRECTION | _MM_FROUND_NO_EXC));
      sums[k / 2] = _mm256_add_epi32(sums[k / 2], q);
      const __m256i bytes = _mm256_shuffle_epi8(q, low_bytes);
      const int32_t low = _mm256_extract_epi32(bytes, 0), high = _mm256_extract_epi32(bytes, 4);
      std::memcpy(r.q.data() + i * GROUP + 8 * k, &low, 4);
      std::memcpy(r.q.data() + i * GROUP + 8 * k + 4, &high, 4);
    }
    int32_t each[2][8];
    for (int half = 0; half < 2; ++half) _mm256_storeu_si256(reinterpret_cast<__m256i*>(each[half]), sums[half]);
    const int32_t first = std::accumulate(each[0], each[0] + 8, 0), second = std::accumulate(each[1], each[1] + 8, 0);
    const int32_t sum = first + second;
    r.d[i] = d, r.s[3 * i] = sum, r.s[3 * i + 1] = first, r.s[3 * i + 2] = second;
    r.ds[i] = d * static_cast<float>(sum);
  }
  return r;
}

// How far ahead of the group being multiplied its thread asks for codes: a decoding step streams every weight from
// memory once, and the hardware's own prefetching left a 1B model's step ~10 % slower (12 KB ahead was the best of the
// 1, 4, 12, 24 and 40 KB tried).
constexpr int64_t PREFETCH_BYTES = 12 << 10;

// Ask for one group's worth of code bytes PREFETCH_BYTES after c.
inline void prefetch_group(const uint8_t* c, int64_t bytes) {
  for (int64_t line = 0; line < bytes; line += 64)
    _mm_prefetch(reinterpret_cast<const char*>(c + PREFETCH_BYTES + line), _MM_HINT_T0);
}

int32_t load4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// Eight (sixteen) int8 integers as float32.
inline __m256 widened8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
WIDE inline __m512 widened16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// A layer's form, one instantiation of the tiles each: 4-bit or 8-bit codes, a min or not, a scale per 16 weights or
// per 32, float32 or float16 scales.
// K: the scales and mins are int8 integers per group times float16 ones per block of 8 groups (a K-quant's, as its
// file keeps them), multiplied here into the very float32 products a float32 scale would hold (exact: a float16 times
// at most 7 bits).
template <bool Q4_, bool MIN_, bool HALVES_, typename S_, bool K_ = false>
struct Form {
  static constexpr bool Q4 = Q4_, MIN = MIN_, HALVES = HALVES_, K = K_;
  using S = S_;
  static constexpr int64_t code_bytes = Q4 ? 256 : 512, scales_per_group = HALVES ? 2 : 1;
};

// Half h (features 8h .. 8h + 7) of tile t for ROWS rows, AVX2.
template <int ROWS, typename F>
void int8_half_avx2(const Int8Layer& w, const Int8Rows& x, int64_t row0, int64_t t, int h, float (*out)[8]) {
  using S = typename F::S;
  const S* scales = static_cast<const S*>(w.scales);
  const S* mins = static_cast<const S*>(w.mins);
  const __m256i nibble = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 acc[ROWS], low[ROWS];
  for (int i = 0; i < ROWS; ++i) acc[i] = low[i] = _mm256_setzero_ps();
  for (int64_t g = 0; g < w.groups; ++g) {
    const int64_t tg = t * w.groups + g;
    const uint8_t* c = static_cast<const uint8_t*>(w.codes) + tg * F::code_bytes + 32 * h;
    if (h == 0) prefetch_group(c, F::code_bytes);  // the first half's pass streams the tile from memory
    __m256i lanes[8], magnitudes[8];  // 4-bit: the 8 chunks' weights 0..15; 8-bit: the signed weights and |w|
    if (F::Q4) {
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
    __m256 dw, dw_high, mw = _mm256_setzero_ps();
    if constexpr (F::K) {
      const int8_t* sg = static_cast<const int8_t*>(w.scales) + tg * F::scales_per_group * LANES + 8 * h;
      const int64_t block = t * w.blocks + g / 8;
      const __m256 d = load8(w.block_scales + block * LANES + 8 * h);
      dw = _mm256_mul_ps(widened8(sg), d);
      dw_high = F::HALVES ? _mm256_mul_ps(widened8(sg + LANES), d) : dw;
      if (F::MIN)
        mw = _mm256_mul_ps(widened8(static_cast<const int8_t*>(w.mins) + tg * LANES + 8 * h),
                           load8(w.block_mins + block * LANES + 8 * h));
    } else {
      const S* sg = scales + tg * F::scales_per_group * LANES + 8 * h;
      dw = load8(sg), dw_high = F::HALVES ? load8(sg + LANES) : dw;
      if (F::MIN) mw = load8(mins + tg * LANES + 8 * h);
    }
    for (int i = 0; i < ROWS; ++i) {
      const int64_t at = (row0 + i) * w.groups + g;
      const int8_t* xq = x.q.data() + at * GROUP;
      __m256i sums[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
      if constexpr (F::Q4 || F::HALVES) {
        // Codes of at most 32 in magnitude (4-bit ones, Q6_K's): four pairs' 16-bit sums add up without overflow
        // (each |pair| <= 2 * 32 * 127, four <= 32,512), so they are widened to 32 bits once a half, not each.
        __m256i pair_sums[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
        for (int r = 0; r < 8; ++r) {
          const __m256i xv = _mm256_set1_epi32(load4(xq + 4 * r));
          const __m256i pairs = F::Q4 ? _mm256_maddubs_epi16(lanes[r], xv)
                                      : _mm256_maddubs_epi16(magnitudes[r], _mm256_sign_epi8(xv, lanes[r]));
          pair_sums[r / 4] = _mm256_add_epi16(pair_sums[r / 4], pairs);
        }
        for (int half = 0; half < 2; ++half) sums[half] = _mm256_madd_epi16(pair_sums[half], ones);
      } else {
        for (int r = 0; r < 8; ++r) {
          const __m256i xv = _mm256_set1_epi32(load4(xq + 4 * r));
          const __m256i pairs = _mm256_maddubs_epi16(magnitudes[r], _mm256_sign_epi8(xv, lanes[r]));
          sums[r / 4] = _mm256_add_epi32(sums[r / 4], _mm256_madd_epi16(pairs, ones));
        }
      }
      const __m256 dx = _mm256_set1_ps(x.d[at]);
      if (F::HALVES) {
        acc[i] = _mm256_add_ps(acc[i], _mm256_mul_ps(_mm256_cvtepi32_ps(sums[0]), _mm256_mul_ps(dw, dx)));
        acc[i] = _mm256_add_ps(acc[i], _mm256_mul_ps(_mm256_cvtepi32_ps(sums[1]), _mm256_mul_ps(dw_high, dx)));
      } else {
        const __m256i sum = _mm256_add_epi32(sums[0], sums[1]);
        acc[i] = _mm256_add_ps(acc[i], _mm256_mul_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(dw, dx)));
      }
      if (F::MIN) low[i] = _mm256_add_ps(low[i], _mm256_mul_ps(mw, _mm256_set1_ps(x.ds[at])));
    }
  }
  for (int i = 0; i < ROWS; ++i) _mm256_storeu_ps(out[i], F::MIN ? _mm256_add_ps(acc[i], low[i]) : acc[i]);
}

#define VNNI __attribute__((target("avx512f,avx512bw,avx512dq,avx512vnni")))

// Tile t for ROWS rows, AVX-512 VNNI: the weights go in as unsigned bytes (8-bit codes shifted by 128, and 128 * s
// taken off each integer sum after).
template <int ROWS, typename F>
VNNI void int8_tile_vnni(const Int8Layer& w, const Int8Rows& x, int64_t row0, int64_t t, float (*out)[LANES]) {
  using S = typename F::S;
  const S* scales = static_cast<const S*>(w.scales);
  const S* mins = static_cast<const S*>(w.mins);
  const __m512i nibble = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc[ROWS], low[ROWS];
  for (int i = 0; i < ROWS; ++i) acc[i] = low[i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < w.groups; ++g) {
    const int64_t tg = t * w.groups + g;
    const uint8_t* c = static_cast<const uint8_t*>(w.codes) + tg * F::code_bytes;
    prefetch_group(c, F::code_bytes);
    __m512i lanes[8];
    if (F::Q4) {
      for (int r = 0; r < 4; ++r) {
        const __m512i v = _mm512_loadu_si512(c + 64 * r);
        lanes[r] = _mm512_and_si512(v, nibble);
        lanes[r + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
      }
    } else {
      for (int r = 0; r < 8; ++r) lanes[r] = _mm512_xor_si512(_mm512_loadu_si512(c + 64 * r), flip);
    }
    __m512 dw, dw_high, mw = _mm512_setzero_ps();
    if constexpr (F::K) {
      const int8_t* sg = static_cast<const int8_t*>(w.scales) + tg * F::scales_per_group * LANES;
      const int64_t block = t * w.blocks + g / 8;
      const __m512 d = load16(w.block_scales + block * LANES);
      dw = _mm512_mul_ps(widened16(sg), d);
      dw_high = F::HALVES ? _mm512_mul_ps(widened16(sg + LANES), d) : dw;
      if (F::MIN)
        mw = _mm512_mul_ps(widened16(static_cast<const int8_t*>(w.mins) + tg * LANES), load16(w.block_mins + block * LANES));
    } else {
      const S* sg = scales + tg * F::scales_per_group * LANES;
      dw = load16(sg), dw_high = F::HALVES ? load16(sg + LANES) : dw;
      if (F::MIN) mw = load16(mins + tg * LANES);
    }
    for (int i = 0; i < ROWS; ++i) {
      const int64_t at = (row0 + i) * w.groups + g;
      const int8_t* xq = x.q.data() + at * GROUP;
      __m512i sums[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
      for (int r = 0; r < 8; ++r)
        sums[r / 4] = _mm512_dpbusd_epi32(sums[r / 4], lanes[r], _mm512_set1_epi32(load4(xq + 4 * r)));
      if (!F::Q4)
        for (int half = 0; half < 2; ++half)
          sums[half] = _mm512_sub_epi32(sums[half], _mm512_set1_epi32(128 * x.s[3 * at + 1 + half]));
      const __m512 dx = _mm512_set1_ps(x.d[at]);
      if (F::HALVES) {
        acc[i] = _mm512_add_ps(acc[i], _mm512_mul_ps(_mm512_cvtepi32_ps(sums[0]), _mm512_mul_ps(dw, dx)));
        acc[i] = _mm512_add_ps(acc[i], _mm512_mul_ps(_mm512_cvtepi32_ps(sums[1]), _mm512_mul_ps(dw_high, dx)));
      } else {
        const __m512i sum = _mm512_add_epi32(sums[0], sums[1]);
        acc[i] = _mm512_add_ps(acc[i], _mm512_mul_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(dw, dx)));
      }
      if (F::MIN) low[i] = _mm512_add_ps(low[i], _mm512_mul_ps(mw, _mm512_set1_ps(x.ds[at])));
    }
  }
  for (int i = 0; i < ROWS; ++i) _mm512_storeu_ps(out[i], F::MIN ? _mm512_add_ps(acc[i], low[i]) : acc[i]);
}

// Tile t for rows row0 .. row0 + ROWS - 1 into a [ROWS][LANES] block.
template <int ROWS, typename F>
void int8_tile(bool vnni, const Int8Layer& w, const Int8Rows& x, int64_t row0, int64_t t, float (*block)[LANES]) {
  if (vnni) {
    int8_tile_vnni<ROWS, F>(w, x, row0, t, block);
    return;
  }
  for (int h = 0; h < 2; ++h) {
    float half[ROWS][8];
    int8_half_avx2<ROWS, F>(w, x, row0, t, h, half);
    for (int i = 0; i < ROWS; ++i) std::memcpy(block[i] + 8 * h, half[i], sizeof half[i]);
  }
}

// Tile t of layer w for all `count` rows, four at a time (more spill the registers: measured), into out [count,
// width] from column `column` on (+ bias).
template <typename F>
void int8_tile_rows(bool vnni, const Int8Layer& w, const Int8Rows& x, int64_t count, int64_t t, float* out,
                    int64_t width, int64_t column, const float* bias) {
  float block[4][LANES];
  const int64_t n0 = t * LANES, valid = std::min<int64_t>(LANES, w.out_features - n0);
  for (int64_t i = 0; i < count; i += 4) {
    const int rows_here = static_cast<int>(std::min<int64_t>(4, count - i));
    switch (rows_here) {
      case 1: int8_tile<1, F>(vnni, w, x, i, t, block); break;
      case 2: int8_tile<2, F>(vnni, w, x, i, t, block); break;
      case 3: int8_tile<3, F>(vnni, w, x, i, t, block); break;
      default: int8_tile<4, F>(vnni, w, x, i, t, block);
    }
    for (int r = 0; r < rows_here; ++r)
      for (int64_t f = 0; f < valid; ++f)
        out[(i + r) * width + column + n0 + f] = bias ? block[r][f] + bias[n0 + f] : block[r][f];
  }
}

template <typename S, bool K = false>
void tile_rows_of(const Int8Layer& w, bool vnni, const Int8Rows& x, int64_t count, int64_t t, float* out,
                  int64_t width, int64_t column, const float* bias) {
  if (w.q4) {  // 4-bit codes always come with a min (Q4_0's is -8 d)
    int8_tile_rows<Form<true, true, false, S, K>>(vnni, w, x, count, t, out, width, column, bias);
  } else if (w.halves) {
    int8_tile_rows<Form<false, false, true, S, K>>(vnni, w, x, count, t, out, width, column, bias);
  } else if (w.mins) {
    int8_tile_rows<Form<false, true, false, S, K>>(vnni, w, x, count, t, out, width, column, bias);
  } else {
    int8_tile_rows<Form<false, false, false, S, K>>(vnni, w, x, count, t, out, width, column, bias);
  }
}

}  // namespace

Int8Layer int8_layer(const at::Tensor& codes, const at::Tensor& scales, const std::optional<at::Tensor>& mins,
                     const std::optional<at::Tensor>& block_scales, const std::optional<at::Tensor>& block_mins,
                     int64_t out_features, int64_t in_features) {
  const int64_t groups = in_features / GROUP, tiles = (out_features + LANES - 1) / LANES;
  const bool q4 = codes.scalar_type() == at::kByte, halves = scales.dim() == 4;
  const bool k = block_scales.has_value() && block_scales->numel() > 0;
  TORCH_CHECK(in_features % GROUP == 0, "int8 linear layers need in_features divisible by ", GROUP, ", got ",
              in_features);
  TORCH_CHECK(q4 || codes.scalar_type() == at::kChar, "int8 layer codes are uint8 (4-bit) or int8 (8-bit)");
  TORCH_CHECK(codes.is_contiguous() && codes.numel() == tiles * groups * (q4 ? 256 : 512),
              "codes must be contiguous, repacked for ", out_features, " x ", in_features, " (engine/model/quant.py)");
  const std::vector<int64_t> scale_shape =
      halves ? std::vector<int64_t>{tiles, groups, 2, LANES} : std::vector<int64_t>{tiles, groups, LANES};
  const auto scale_type = scales.scalar_type();
  TORCH_CHECK((k ? scale_type == at::kChar : scale_type == at::kHalf || scale_type == at::kFloat) &&
                  scales.is_contiguous() && scales.sizes() == at::IntArrayRef(scale_shape),
              "scales must be contiguous float16 or float32 (int8 with block scales) [tiles, in_features / 32, (2,) 16]");
  const bool has_mins = mins.has_value() && mins->numel() > 0;
  TORCH_CHECK(!has_mins || (mins->scalar_type() == scale_type && mins->is_contiguous() &&
                            mins->sizes() == at::IntArrayRef({tiles, groups, LANES})),
              "mins must be contiguous [tiles, in_features / 32, 16] of the scales' dtype");
  TORCH_CHECK(!(halves && has_mins) && (has_mins || !q4), "int8 layers: 4-bit codes take mins; two scales a group "
              "none");
  const int64_t blocks = groups / 8;
  if (k) {
    const bool has_block_mins = block_mins.has_value() && block_mins->numel() > 0;
    TORCH_CHECK(groups % 8 == 0 && block_scales->scalar_type() == at::kHalf && block_scales->is_contiguous() &&
                    block_scales->sizes() == at::IntArrayRef({tiles, blocks, LANES}) && has_block_mins == has_mins &&
                    (!has_mins || (block_mins->scalar_type() == at::kHalf && block_mins->is_contiguous() &&
                                   block_mins->sizes() == block_scales->sizes())),
                "block scales and mins must be contiguous float16 [tiles, in_features / 256, 16], mins with mins");
  }
  return {codes.data_ptr(), scales.data_ptr(), has_mins ? mins->data_ptr() : nullptr,
          k ? block_scales->data_ptr<at::Half>() : nullptr, k && has_mins ? block_mins->data_ptr<at::Half>() : nullptr,
          groups, blocks, out_features, q4, halves, scale_type == at::kFloat};
}

at::Tensor int8_linears(const at::Tensor& x, const std::vector<Int8Layer>& layers,
                        const std::vector<const float*>& biases) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "int8 linear layers take float32 inputs, got ", x.scalar_type());
  TORCH_CHECK(!layers.empty() && biases.size() == layers.size(), "int8_linears: one bias (or none) a layer");
  const int64_t in = x.size(-1);
  std::vector<int64_t> columns{0}, tile_starts{0};
  for (const Int8Layer& w : layers) {
    TORCH_CHECK(in == w.groups * GROUP, "int8 linear layer: ", in, " inputs for a layer of ", w.groups * GROUP);
    columns.push_back(columns.back() + w.out_features);
    tile_starts.push_back(tile_starts.back() + (w.out_features + LANES - 1) / LANES);
  }
  const at::Tensor rows = x.reshape({-1, in}).contiguous();
  const int64_t count = rows.size(0), width = columns.back();
  const Int8Rows xq = quantize_rows(rows.data_ptr<float>(), count, in);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = width;
  at::Tensor out = at::empty({count, width}, x.options());
  float* os = out.data_ptr<float>();
  const bool vnni = use_vnni;
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / (LANES * in));
  // One parallel loop over every layer's tiles: layers that take the same input share the rounding of it and a
  // single split of the work, as if stacked, and each output feature is computed as in its own layer.
  parallel_chunks(0, tile_starts.back(), grain, [&](int64_t first, int64_t last) {
    size_t l = std::upper_bound(tile_starts.begin(), tile_starts.end(), first) - tile_starts.begin() - 1;
    for (int64_t tile = first; tile < last; ++tile) {
      while (tile >= tile_starts[l + 1]) ++l;
      const Int8Layer& w = layers[l];
      const int64_t t = tile - tile_starts[l];
      if (w.block_scales) tile_rows_of<at::Half, true>(w, vnni, xq, count, t, os, width, columns[l], biases[l]);
      else if (w.float_scales) tile_rows_of<float>(w, vnni, xq, count, t, os, width, columns[l], biases[l]);
      else tile_rows_of<at::Half>(w, vnni, xq, count, t, os, width, columns[l], biases[l]);
    }
  });
  return out.view(shape);
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                       const std::optional<at::Tensor>& mins, const std::optional<at::Tensor>& block_scales,
                       const std::optional<at::Tensor>& block_mins, const std::optional<at::Tensor>& bias,
                       int64_t out_features) {
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                                    bias->numel() == out_features),
              "int8 linear layers take a contiguous float32 bias of out_features");
  const Int8Layer w = int8_layer(codes, scales, mins, block_scales, block_mins, out_features, x.size(-1));
  return int8_linears(x, {w}, {bias.has_value() ? bias->data_ptr<float>() : nullptr});
}


namespace {

// Element i of a repacked scale or min tensor as float32: a float16 or float32 value, or an int8 one times its
// block's float16 factor (a K-quant's), the product exact in float32 as Repacked.float_scales makes it.
float factor(const Int8Layer& w, const void* values, const at::Half* block, int64_t i, int64_t block_i) {
  if (block) return static_cast<float>(static_cast<const int8_t*>(values)[i]) * static_cast<float>(block[block_i]);
  if (w.float_scales) return static_cast<const float*>(values)[i];
  return static_cast<float>(static_cast<const at::Half*>(values)[i]);
}

}  // namespace

at::Tensor int8_rows(const at::Tensor& ids, const at::Tensor& codes, const at::Tensor& scales,
                     const std::optional<at::Tensor>& mins, const std::optional<at::Tensor>& block_scales,
                     const std::optional<at::Tensor>& block_mins, int64_t out_features) {
  const int64_t groups = codes.size(1), in = groups * GROUP;
  const Int8Layer w = int8_layer(codes, scales, mins, block_scales, block_mins, out_features, in);
  const at::Tensor which = ids.to(at::kLong).contiguous();
  const int64_t count = which.numel();
  const int64_t* rows = which.data_ptr<int64_t>();
  for (int64_t r = 0; r < count; ++r)
    TORCH_CHECK(rows[r] >= 0 && rows[r] < out_features, "int8_rows: row ", rows[r], " of a table of ", out_features);
  std::vector<int64_t> shape(ids.sizes().begin(), ids.sizes().end());
  shape.push_back(in);
  at::Tensor out = at::empty({count, in}, scales.options().dtype(at::kFloat));
  float* os = out.data_ptr<float>();
  const int64_t chunks = w.q4 ? 4 : 8, scales_a_group = w.halves ? 2 : 1;
  for (int64_t r = 0; r < count; ++r) {
    const int64_t tile = rows[r] / LANES, lane = rows[r] % LANES;
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t at = (tile * groups + g) * LANES + lane, block = (tile * w.blocks + g / 8) * LANES + lane;
      float s[2], m = 0.f;
      for (int64_t h = 0; h < scales_a_group; ++h)
        s[h] = factor(w, w.scales, w.block_scales, ((tile * groups + g) * scales_a_group + h) * LANES + lane, block);
      if (w.mins) m = factor(w, w.mins, w.block_mins, at, block);
      float* o = os + r * in + g * GROUP;
      const int64_t first = ((tile * groups + g) * chunks * LANES + lane) * 4;  // chunk 0's 4 bytes of this lane
      for (int64_t c = 0; c < chunks; ++c)
        for (int64_t k = 0; k < 4; ++k) {
          const int64_t j = 4 * c + k, byte = first + c * LANES * 4 + k;
          if (w.q4) {
            const uint8_t pair = static_cast<const uint8_t*>(w.codes)[byte];
            o[j] = static_cast<float>(pair & 15) * s[0];
            o[j + 16] = static_cast<float>(pair >> 4) * s[0];
          } else {
            o[j] = static_cast<float>(static_cast<const int8_t*>(w.codes)[byte]) * s[w.halves ? j / 16 : 0];
          }
        }
      if (w.mins)
        for (int64_t j = 0; j < GROUP; ++j) o[j] = o[j] + m;
    }
  }
  return out.view(shape);
}

}  // namespace eagle_cpu
