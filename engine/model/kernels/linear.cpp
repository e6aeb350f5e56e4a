// grouped_linear: float32 rows against a GGUF's Q4_1 or Q8_0 weight groups, each group dequantized in registers and
// used at once for up to eight rows (kernels.h has the whole design).
#include "kernels.h"

#include <algorithm>

namespace eagle_cpu {
namespace {

constexpr int64_t TILE = 8;  // output features per task unit

// AVX-512 where the CPU has it: two output features in one 16-lane vector, each lane making the very operations
// of the 8-lane path (same loads, conversions, FMAs in the same order, the same hsum of each half), so a result has
// the same bits on either path and on any x86 CPU (tests/test_quant.py compares them); half the instructions.
// The formats and multiply_block are written once for both (kernels.h, "8 and 16 lanes").

// Part p (elements 8p..8p+7) of the 32 weights of group g of one output feature, dequantized into float32; on V's
// lanes, of V::blocks features from `row` on, feature row + k in block k.
// Q4_1: 16 bytes per group, byte j holding element j (low nibble) and element j + 16 (high nibble).
struct Q4_1 {
  // Output features multiplied side by side for `rows` input rows (fastest on AVX2 Zen 3, measured 1-8 rows).
  static constexpr int feats(int rows) { return rows == 1 ? 4 : rows <= 3 ? 2 : 1; }
  const uint8_t* codes;
  const float *scales, *mins;
  int64_t in;
  template <typename V>
  __attribute__((always_inline)) typename V::F part(int64_t row, int64_t g, int p) const {
    const int64_t at = row * (in / GROUP) + g, next = in / GROUP;  // group g of feature row + k: at + k * next
    // widened first (the load folds into it), nibbles split per lane
    typename V::I wide = V::widen_u8(codes + at * GROUP / 2 + (p & 1) * 8, next * GROUP / 2);
    if (p >= 2) wide = V::shift_right(wide, 4);
    const typename V::F q = V::to_float(V::and_bits(wide, 0x0F));
    return V::fmadd(q, V::per_block(scales + at, next), V::per_block(mins + at, next));
  }
};

// Q8_0: 32 signed bytes per group.
struct Q8_0 {
  static constexpr int feats(int rows) { return rows <= 5 ? 2 : 1; }  // its dequantization is cheaper: more rows
  const int8_t* codes;
  const float* scales;
  int64_t in;
  template <typename V>
  __attribute__((always_inline)) typename V::F part(int64_t row, int64_t g, int p) const {
    const int64_t at = row * (in / GROUP) + g, next = in / GROUP;
    return V::mul(V::to_float(V::widen_i8(codes + at * GROUP + p * 8, next * GROUP)), V::per_block(scales + at, next));
  }
};

// ROWS input rows against FEATS output features at once: each group of a feature's weights dequantized in registers
// and used at once for every row. Per output, one 8-lane accumulator sums the group's four vectors in order, group
// after group, then hsum: the same operations whatever ROWS and FEATS are, so a row's bits never depend on the rows
// beside it. Several features side by side give the FMA units independent chains to overlap (one feature and one row
// would wait on each FMA's latency) and share each load of x. (Dequantizing a tile to memory first cost twice as much
// for 2-16 rows; measured.)
// On V's lanes, FEATS = VECTORS * V::blocks: each vector holds V::blocks features' 8-lane accumulators side by side.
template <typename V, int ROWS, int VECTORS, typename Format>
__attribute__((always_inline)) inline void multiply_block(const float* x, const Format& format, int64_t n0,
                                                         const float* bias, float* out, int64_t out_stride) {
  constexpr int PER = V::blocks;  // features a vector
  const int64_t in = format.in;
  typename V::F acc[ROWS * VECTORS];
  for (int a = 0; a < ROWS * VECTORS; ++a) acc[a] = V::zero();
  for (int64_t g = 0; g < in / GROUP; ++g)
    for (int part = 0; part < 4; ++part) {
      typename V::F xv[ROWS];
      for (int i = 0; i < ROWS; ++i) xv[i] = V::repeat(x + i * in + g * GROUP + 8 * part);
      for (int f = 0; f < VECTORS; ++f) {
        const typename V::F w = format.template part<V>(n0 + PER * f, g, part);
        for (int i = 0; i < ROWS; ++i) acc[i * VECTORS + f] = V::fmadd(xv[i], w, acc[i * VECTORS + f]);
      }
    }
  for (int i = 0; i < ROWS; ++i)
    for (int f = 0; f < VECTORS; ++f) {  // the blocks written out, not looped over: a loop kept acc in memory
      out[i * out_stride + PER * f] = hsum(V::block(acc[i * VECTORS + f], 0)) + (bias ? bias[PER * f] : 0.f);
      if constexpr (PER == 2)
        out[i * out_stride + PER * f + 1] = hsum(V::block(acc[i * VECTORS + f], 1)) + (bias ? bias[PER * f + 1] : 0.f);
    }
}

// ROWS rows against the tile's `valid` features, on AVX-512: two features a vector, PAIRS vectors at a time.
template <int ROWS, typename Format>
WIDE_FLAT void multiply_tile_wide(const float* x, const Format& format, int64_t n0, int64_t valid, const float* bias,
                                  float* out, int64_t out_stride) {
  constexpr int PAIRS = ROWS <= 4 ? 2 : 1;  // measured on Zen 5, 1-8 rows
  int64_t f = 0;
  for (; f + 2 * PAIRS <= valid; f += 2 * PAIRS)
    multiply_block<Lanes16, ROWS, PAIRS>(x, format, n0 + f, bias ? bias + f : nullptr, out + f, out_stride);
  for (; f + 2 <= valid; f += 2)
    multiply_block<Lanes16, ROWS, 1>(x, format, n0 + f, bias ? bias + f : nullptr, out + f, out_stride);
  for (; f < valid; ++f)
    multiply_block<Lanes8, ROWS, 1>(x, format, n0 + f, bias ? bias + f : nullptr, out + f, out_stride);
}

// ROWS rows against the tile's `valid` features, FEATS at a time (the fewer rows, the more side by side).
template <int ROWS, typename Format>
void multiply_tile(const float* x, const Format& format, int64_t n0, int64_t valid, const float* bias, float* out,
                   int64_t out_stride) {
  constexpr int FEATS = Format::feats(ROWS);
  int64_t f = 0;
  for (; f + FEATS <= valid; f += FEATS)
    multiply_block<Lanes8, ROWS, FEATS>(x, format, n0 + f, bias ? bias + f : nullptr, out + f, out_stride);
  for (; f < valid; ++f)
    multiply_block<Lanes8, ROWS, 1>(x, format, n0 + f, bias ? bias + f : nullptr, out + f, out_stride);
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
  parallel_chunks(0, tiles, grain, [&](int64_t first, int64_t last) {
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

}  // namespace

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

}  // namespace eagle_cpu
