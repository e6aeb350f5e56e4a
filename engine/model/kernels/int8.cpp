// int8 activations (kernels="int8"): llama.cpp's arithmetic on the GGUF's groups.
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
#include "kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <numeric>

namespace eagle_cpu {
namespace {

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

}  // namespace

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

}  // namespace eagle_cpu
