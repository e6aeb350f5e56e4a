// The fixed-order attention: softmax(q.k * scale + mask) v per (row, head) over the keys the row sees, in key
// order, so a row's bits depend on its visible keys alone (kernels.h has the whole design).
#include "kernels.h"

#include <algorithm>
#include <cfloat>
#include <memory>
#include <numeric>
#include <type_traits>

namespace eagle_cpu {
namespace {

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

// exp(x) for x <= 0 (Cody-Waite range reduction and a degree-6 polynomial, ~1 ulp): one function for every score.
// Its constants, shared by the 8- and 16-lane versions so that the two cannot drift apart.
struct ExpConstants {
  static constexpr float lowest = -87.f, log2e = 1.44269504088896341f, ln2_high = 0.693359375f,
                         ln2_low = -2.12194440e-4f;
  static constexpr float poly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                                    4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
};

// On V's lanes (kernels.h, "8 and 16 lanes"), the 16 lane for lane the same operations as the 8. (Its argument by
// reference: GCC notes a 16-lane one by value as another ABI.)
template <typename V>
__attribute__((always_inline)) inline typename V::F exp_nonpositive(const typename V::F& in) {
  using C = ExpConstants;
  const typename V::F x = V::max(in, V::set1(C::lowest));
  const typename V::F n = V::round(V::mul(x, V::set1(C::log2e)));
  typename V::F r = V::fnmadd(n, V::set1(C::ln2_high), x);
  r = V::fnmadd(n, V::set1(C::ln2_low), r);
  typename V::F p = V::set1(C::poly[0]);
  for (int i = 1; i < 6; ++i) p = V::fmadd(p, r, V::set1(C::poly[i]));
  p = V::fmadd(p, V::mul(r, r), V::add(r, V::set1(1.f)));
  return V::mul(p, V::pow2(n));
}

// Ask for `bytes` from p on into L1 ahead of use (one row of a call does, for the rows after it): keys and values
// stream from memory faster than the hardware prefetcher alone fetches them. (always_inline: GCC takes a call to a
// function that only prefetches for one without effect, and drops it where it is not inlined at once, as in
// mix_values_on's callers.)
__attribute__((always_inline)) inline void prefetch(const void* p, int64_t bytes) {
  for (int64_t c = 0; c < bytes; c += 64) _mm_prefetch(reinterpret_cast<const char*>(p) + c, _MM_HINT_T0);
}

// Score = hsum of one 8-lane accumulator over the head dimension in order, * scale + mask, for Q query heads that
// share a key/value head, over `count` of a row's visible keys (KEYS keys side by side: Q * KEYS independent FMA
// chains, their hsums four at a time; the last count % KEYS one at a time). A key's score is the same sequence
// whichever of the two ways it takes. KEYS is 3 for three heads, so that the accumulators, the keys and a query fit
// AVX2's 16 registers (four would spill an accumulator to the stack: a store and a load on its chain each step).
template <int Q, typename T>
void score_keys(const Heads<T>& k, int64_t b, int64_t g, int64_t dim, const int64_t* keys, const float* masks,
                int64_t count, const float* const* queries, float scale, float* const* weights, bool fetch) {
  constexpr int KEYS = Q == 3 ? 3 : 4;
  int64_t j = 0;
  for (; j + KEYS <= count; j += KEYS) {
    const T* key[KEYS];
    for (int t = 0; t < KEYS; ++t) key[t] = k.at(b, g, keys[j + t]);
    if (fetch && j + 32 < count) prefetch(k.at(b, g, keys[j + 32]), KEYS * dim * sizeof(T));
    __m256 acc[Q][KEYS];
    for (int h = 0; h < Q; ++h)
      for (int t = 0; t < KEYS; ++t) acc[h][t] = _mm256_setzero_ps();
    for (int64_t d = 0; d < dim; d += 8)
      for (int h = 0; h < Q; ++h) {
        const __m256 qv = _mm256_loadu_ps(queries[h] + d);
        for (int t = 0; t < KEYS; ++t) acc[h][t] = _mm256_fmadd_ps(qv, load8(key[t] + d), acc[h][t]);
      }
    for (int h = 0; h < Q; ++h) {
      const __m128 sums = hsum4(acc[h][0], acc[h][1], acc[h][2], acc[h][KEYS - 1]);
      if constexpr (KEYS == 4) {
        _mm_storeu_ps(weights[h] + j, _mm_add_ps(_mm_mul_ps(sums, _mm_set1_ps(scale)), _mm_loadu_ps(masks + j)));
      } else {
        float each[4];
        _mm_storeu_ps(each, sums);
        for (int t = 0; t < KEYS; ++t) weights[h][j + t] = each[t] * scale + masks[j + t];
      }
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
    const __m256 e = exp_nonpositive<Lanes8>(_mm256_sub_ps(_mm256_loadu_ps(w + i), _mm256_set1_ps(most)));
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

// The same on 16 lanes, the sum still 8-lane blocks in order.
WIDE_FLAT float exponentiate_wide(float* w, int64_t count) {
  __m512 top = _mm512_set1_ps(-FLT_MAX);
  int64_t i = 0;
  for (; i + 16 <= count; i += 16) top = _mm512_max_ps(top, _mm512_loadu_ps(w + i));
  float most = _mm512_reduce_max_ps(top);
  for (; i < count; ++i) most = std::max(most, w[i]);
  __m256 total = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 16 <= count; j += 16) {
    const __m512 e = exp_nonpositive<Lanes16>(_mm512_sub_ps(_mm512_loadu_ps(w + j), _mm512_set1_ps(most)));
    _mm512_storeu_ps(w + j, e);
    total = _mm256_add_ps(_mm256_add_ps(total, _mm512_castps512_ps256(e)), _mm512_extractf32x8_ps(e, 1));
  }
  return hsum(exponentiate_from(w, j, count, most, total));
}

// Output dimensions d0 .. d0 + 8 WIDTH of Q query heads: the sum over the row's visible keys in order of weight *
// value, then / the weights' sum (Q * WIDTH accumulators in registers). On V's lanes: on 16, 16 output dimensions a
// vector, each lane the same sequence (WIDTH even).
template <typename V, int Q, int WIDTH, typename T>
__attribute__((always_inline)) inline void mix_values_on(const Heads<T>& v, int64_t b, int64_t g, const Visible& seen,
                                                         const float* const* weights, const float* totals, int64_t d0,
                                                         float* const* outs, bool fetch) {
  constexpr int VECTORS = WIDTH / V::blocks;
  const int64_t* keys = seen.keys.data();
  const int64_t count = seen.count();
  typename V::F acc[Q][VECTORS];
  for (int h = 0; h < Q; ++h)
    for (int x = 0; x < VECTORS; ++x) acc[h][x] = V::zero();
  for (int64_t i = 0; i < count; ++i) {
    const T* value = v.at(b, g, keys[i]) + d0;
    if (fetch && i + 32 < count) prefetch(v.at(b, g, keys[i + 32]) + d0, 8 * WIDTH * sizeof(T));
    for (int x = 0; x < VECTORS; ++x) {
      const typename V::F vx = V::load(value + V::lanes * x);
      for (int h = 0; h < Q; ++h) acc[h][x] = V::fmadd(V::set1(weights[h][i]), vx, acc[h][x]);
    }
  }
  for (int h = 0; h < Q; ++h)
    for (int x = 0; x < VECTORS; ++x)
      V::store(outs[h] + d0 + V::lanes * x, V::div(acc[h][x], V::set1(totals[h])));
}

template <int Q, int WIDTH, typename T>
void mix_values(const Heads<T>& v, int64_t b, int64_t g, const Visible& seen, const float* const* weights,
                const float* totals, int64_t d0, float* const* outs, bool fetch) {
  mix_values_on<Lanes8, Q, WIDTH>(v, b, g, seen, weights, totals, d0, outs, fetch);
}

template <int Q, int WIDTH, typename T>
WIDE_FLAT void mix_values_wide(const Heads<T>& v, int64_t b, int64_t g, const Visible& seen,
                               const float* const* weights, const float* totals, int64_t d0, float* const* outs,
                               bool fetch) {
  mix_values_on<Lanes16, Q, WIDTH>(v, b, g, seen, weights, totals, d0, outs, fetch);
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
    // a multiple of 24, so that a stretch leaves no keys to score one at a time (score_keys takes 3, 4 or 8 at once)
    const int64_t length = (longest + stretches - 1) / stretches / 24 * 24 + 24;
    parallel_chunks(0, kv_heads * parts() * stretches, 1, [&](int64_t t0, int64_t t1) {
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
    parallel_chunks(0, (last - first) * heads, 1, [&](int64_t t0, int64_t t1) {
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
    parallel_chunks(0, kv_heads * parts() * slices, 1, [&](int64_t t0, int64_t t1) {
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

}  // namespace

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

}  // namespace eagle_cpu
