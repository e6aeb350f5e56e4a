// rms_norm, rotary and the residual stream by hand, and the two whole forwards built from them and the other files'
// kernels: a grouped decoder of the Llama, Qwen2, Qwen3 or Gemma 3 family (Decoder::forward) and an EAGLE-3 head
// (Eagle3Head::forward), op for op as transformers runs them, so every output has the very same bits, without Python
// between their ops; their weights are built and checked once (weights.cpp).
#include "kernels.h"

#include <algorithm>
#include <cmath>

namespace eagle_cpu {
namespace {

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

}  // namespace

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

namespace {

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

// h += y, in place (the residual stream: h + y is y + h, the same rounding either way).
void add_into(at::Tensor& h, const at::Tensor& y) {
  TORCH_CHECK(h.is_contiguous() && y.sizes() == h.sizes(), "add_into: a contiguous h and a y of its shape");
  const at::Tensor ys = y.contiguous();
  float* hs = h.data_ptr<float>();
  const float* add = ys.data_ptr<float>();
  for (int64_t i = 0; i < h.numel(); ++i) hs[i] += add[i];
}

// transformers' MLP's act_fn(gate) * up from the stacked gate and up outputs [.., 2 * inner]: torch's own SiLU or
// tanh-approximated GELU (Gemma's GeGLU) on the gate as its own contiguous tensor, as the gate projection gives it,
// the product by hand.
at::Tensor gated(const at::Tensor& gate_up, bool gelu) {
  const int64_t inner = gate_up.size(-1) / 2, rows = gate_up.numel() / gate_up.size(-1);
  const at::Tensor gate = gate_up.narrow(-1, 0, inner).contiguous();
  at::Tensor act = gelu ? at::gelu(gate, "tanh") : at::silu(gate);
  const float* up = gate_up.data_ptr<float>() + inner;
  float* a = act.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < inner; ++j) a[r * inner + j] *= up[r * 2 * inner + j];
  return act;
}

// RMSNorm over each head of the q or k part of a stacked q, k, v output [1, M, F] (from feature `from`, `heads`
// heads), in place: Qwen3's and Gemma 3's q and k norms, each head's row normed as rms_norm norms a row.
void norm_heads(at::Tensor& qkv, int64_t from, int64_t heads, int64_t head_dim, const at::Tensor& weight,
                double eps) {
  const int64_t rows = qkv.size(1);
  const at::Tensor part = qkv.narrow(-1, from, heads * head_dim).reshape({rows * heads, head_dim});
  qkv.narrow(-1, from, heads * head_dim).copy_(rms_norm(part, weight, eps).view({1, rows, heads * head_dim}));
}

// x through one projection's groups on the float kernels: 4-bit codes are Q4_1's (with mins), 8-bit ones Q8_0's.
at::Tensor float_linear(const at::Tensor& x, const Linear& w) {
  return w.codes.scalar_type() == at::kByte ? q4_1_linear(x, w.codes, w.scales, w.mins, maybe(w.bias))
                                            : q8_0_linear(x, w.codes, w.scales, maybe(w.bias));
}

const float* bias_of(const Linear& w) { return w.bias.defined() ? w.bias.data_ptr<float>() : nullptr; }

// x through a linear layer, as its QuantLinear computes it: on the int8 layout or on the float kernels' groups.
at::Tensor linear(const Linear& w, const at::Tensor& x, bool int8) {
  return int8 ? int8_linears(x, {int8_layer(w, x.size(-1))}, {bias_of(w)}) : float_linear(x, w);
}

// The projections `which` of a layer on input x, side by side as stacked ones give them: int8 layers in one call
// (the input rounded once), float-activation ones (q4) each on its own kernel, then joined.
at::Tensor project(const Layer& layer, std::initializer_list<int> which, const at::Tensor& x, bool int8) {
  if (int8) {
    std::vector<Int8Layer> layers;
    std::vector<const float*> biases;
    for (const int p : which) {
      layers.push_back(int8_layer(layer.projections[p], x.size(-1)));
      biases.push_back(bias_of(layer.projections[p]));
    }
    return int8_linears(x, layers, biases);
  }
  std::vector<at::Tensor> outs;
  for (const int p : which) outs.push_back(float_linear(x, layer.projections[p]));
  return outs.size() == 1 ? outs[0] : at::cat(outs, -1);
}

// A cache buffer as the layers write and read it: [1, kv_heads, at least `end` positions, head_dim].
void check_buffer(const at::Tensor& buffer, const Shape& shape, int64_t end, const char* model) {
  TORCH_CHECK(buffer.dim() == 4 && buffer.size(0) == 1 && buffer.size(1) == shape.kv_heads &&
                  buffer.size(2) >= end && buffer.size(3) == shape.head_dim,
              model, ": cache buffers are [1, ", shape.kv_heads, ", at least ", end, ", ", shape.head_dim, "], got ",
              buffer.sizes());
}

}  // namespace

// A decoder-only model's layers and final norm after the embedding and the rotary tables, over M new tokens, op for
// op as transformers runs them on the engine's kernels (grouped linear layers, fixed-order attention), so that every
// output has the very same bits, without Python between the ~40 ops of a layer. One body for the families it
// describes (engine/model/fused.py): Llama, Qwen2 (q, k, v biases), Qwen3 (q and k norms), Gemma 3 (q and k norms,
// a norm after attention and after the MLP, GeGLU, sliding-window layers with their own rotary tables).
// embeddings [1, M, E]; rotary: cos, sin [1, M, head_dim], then the sliding layers' own if they have their own;
// mask as attention() takes it (absent: causal), sliding_mask the sliding layers' (absent: theirs is the mask);
// caches: per layer key and value buffers [1, Hkv, capacity, head_dim] (float32 or float16) with room for
// start + M positions, written at start.
// Returns the final-norm hidden states [1, M, E] and the inputs of the layers listed in `capture`, in its order.
std::tuple<at::Tensor, std::vector<at::Tensor>> Decoder::forward(const at::Tensor& embeddings, const Rotary& rotary,
                                                                 const std::optional<at::Tensor>& mask,
                                                                 const std::optional<at::Tensor>& sliding_mask,
                                                                 const std::vector<at::Tensor>& caches, int64_t start,
                                                                 const std::vector<int64_t>& capture) const {
  const auto& [cos, sin, local_cos, local_sin] = rotary;
  const int64_t count = static_cast<int64_t>(layers.size());
  TORCH_CHECK(embeddings.dim() == 3 && embeddings.size(0) == 1 && embeddings.size(2) == shape.hidden,
              "decoder: embeddings are [1, M, ", shape.hidden, "], got ", embeddings.sizes());
  const int64_t rows = embeddings.size(1), end = start + rows;
  TORCH_CHECK(static_cast<int64_t>(caches.size()) == 2 * count, "decoder: a key and a value buffer a layer, ",
              2 * count, ", got ", caches.size());
  for (const at::Tensor& buffer : caches) check_buffer(buffer, shape, end, "decoder");
  std::vector<at::Tensor> captured(capture.size());
  at::Tensor h = embeddings.contiguous().clone();  // the residual stream, added to in place
  const at::Tensor cos_rows = cos.contiguous(), sin_rows = sin.contiguous();  // themselves, as the tables come
  const at::Tensor local_cos_rows = local_cos.has_value() ? local_cos->contiguous() : cos_rows;
  const at::Tensor local_sin_rows = local_sin.has_value() ? local_sin->contiguous() : sin_rows;
  const std::vector<Visible> visible = visible_rows(mask, 1, rows, end);  // the same in every layer of its kind
  const std::vector<Visible> visible_sliding =
      sliding_mask.has_value() ? visible_rows(sliding_mask, 1, rows, end) : visible;
  const int64_t head_dim = shape.head_dim, qf = shape.heads * head_dim;
  for (int64_t index = 0; index < count; ++index) {
    for (size_t i = 0; i < capture.size(); ++i)
      if (capture[i] == index) captured[i] = h.clone();
    const Layer& w = layers[index];
    const bool local = sliding[index];
    const at::Tensor &keys = caches[2 * index], &values = caches[2 * index + 1];
    at::Tensor qkv = project(w, {Q, K, V}, rms_norm(h, w.norms[INPUT], eps), int8);  // each feature as its projection's
    if (w.norms[Q_NORM].defined()) norm_heads(qkv, 0, shape.heads, head_dim, w.norms[Q_NORM], eps);
    if (w.norms[K_NORM].defined()) norm_heads(qkv, qf, shape.kv_heads, head_dim, w.norms[K_NORM], eps);
    const at::Tensor &layer_cos = local ? local_cos_rows : cos_rows, &layer_sin = local ? local_sin_rows : sin_rows;
    const at::Tensor q = rotated(qkv, 0, shape.heads, head_dim, layer_cos, layer_sin);
    write_keys_values(qkv, qf, head_dim, layer_cos, layer_sin, keys, values, start);
    const at::Tensor attended = attend(q, keys.slice(2, 0, end), values.slice(2, 0, end),
                                       local ? visible_sliding : visible, scale);
    at::Tensor y = project(w, {O}, attended.reshape({1, rows, -1}), int8);
    add_into(h, w.norms[POST_ATTENTION].defined() ? rms_norm(y, w.norms[POST_ATTENTION], eps) : y);
    y = project(w, {DOWN}, gated(project(w, {GATE, UP}, rms_norm(h, w.norms[PRE_MLP], eps), int8), gelu), int8);
    add_into(h, w.norms[POST_MLP].defined() ? rms_norm(y, w.norms[POST_MLP], eps) : y);
  }
  for (size_t i = 0; i < capture.size(); ++i)
    TORCH_CHECK(captured[i].defined(), "decoder: no layer ", capture[i], " to capture");
  return {rms_norm(h, final_norm, eps), captured};
}

void Eagle3Head::set_rotary(const at::Tensor& cos_table, const at::Tensor& sin_table) {
  TORCH_CHECK(cos_table.scalar_type() == at::kFloat && cos_table.dim() == 2 && cos_table.size(1) == shape.head_dim &&
                  sin_table.sizes() == cos_table.sizes() && sin_table.scalar_type() == at::kFloat,
              "EAGLE-3 head: rotary tables are float32 [positions, ", shape.head_dim, "]");
  cos = cos_table, sin = sin_table;
}

// The EAGLE-3 head over T new slots as engine/draft/eagle3.py runs it (fc, the token embeddings, its decoder layer
// with layers.py's Attention and MLP), on Q4_1 or Q8_0 projections, op for op as the Python modules run them, so
// drafts come out with the same bits, without Python between its ~40 ops: a draft round's few rows cost less than
// the Python around them would.
// hidden [1, T, features] (from_target: the base's fused features, through fc) or [1, T, H] (the head's own
// outputs); tokens: their ids [T], and their embeddings [1, T, H] where the head holds no table (else it looks the
// rows up itself); positions [T], rows of the rotary tables (set_rotary); cache: the head's float32 buffers
// [1, Hkv, capacity, head_dim], this call's keys and values written at its start and attention reading positions
// [0, start + T) in place (no copy of the cache); mask bool [1, 1, T, start + T], absent: every cached position and
// the new ones causally.
// Returns the layer's output [1, T, H] and, with `logits`, the draft logits of its last row [V_draft].
std::tuple<at::Tensor, std::optional<at::Tensor>> Eagle3Head::forward(const at::Tensor& hidden, const Tokens& tokens,
                                                                      const at::Tensor& positions,
                                                                      const std::optional<at::Tensor>& mask,
                                                                      const CacheView& cache, bool from_target,
                                                                      bool logits) const {
  const auto& [token_ids, embedded] = tokens;
  const auto& [keys, values, start] = cache;
  TORCH_CHECK(hidden.scalar_type() == at::kFloat && hidden.dim() == 3 && hidden.size(0) == 1,
              "EAGLE-3 head: float32 hidden states [1, T, F]");
  const int64_t rows = hidden.size(1), end = start + rows;
  TORCH_CHECK(token_ids.numel() == rows && positions.numel() == rows, "EAGLE-3 head: a token and a position a row");
  TORCH_CHECK(embedding.has_value() != embedded.has_value(), "EAGLE-3 head: tokens are ids and ",
              embedding ? "no embeddings (the head looks them up)" : "their embeddings (the head holds no table)");
  TORCH_CHECK(keys.scalar_type() == at::kFloat && values.scalar_type() == at::kFloat,
              "EAGLE-3 head: float32 cache buffers");
  check_buffer(keys, shape, end, "EAGLE-3 head");
  TORCH_CHECK(cos.defined(), "EAGLE-3 head: no rotary tables (set_rotary)");
  const Layer& w = layer;
  const at::Tensor h = from_target ? linear(fc, hidden, int8) : hidden;
  at::Tensor embeds;
  if (embedding) {  // GroupedEmbedding: the rows, times its scale if it has one
    const at::Tensor looked_up = int8_rows(token_ids.reshape({-1}), embedding->codes, embedding->scales,
                                           maybe(embedding->mins), maybe(embedding->block_scales),
                                           maybe(embedding->block_mins), vocab);
    embeds = (embedding_scale.defined() ? looked_up * embedding_scale : looked_up).unsqueeze(0);
  } else {
    embeds = *embedded;
  }
  const at::Tensor x = at::cat({rms_norm(embeds, w.norms[INPUT], eps), rms_norm(h, hidden_norm, eps)}, -1);
  const at::Tensor qkv = project(w, {Q, K, V}, x, int8);
  const int64_t heads = shape.heads, head_dim = shape.head_dim, qf = heads * head_dim;
  const at::Tensor at_positions = positions.reshape({-1});
  const at::Tensor cos_rows = cos.index_select(0, at_positions);
  const at::Tensor sin_rows = sin.index_select(0, at_positions);
  const at::Tensor q = rotated(qkv, 0, heads, head_dim, cos_rows, sin_rows);
  write_keys_values(qkv, qf, head_dim, cos_rows, sin_rows, keys, values, start);
  const at::Tensor seen_keys = keys.slice(2, 0, end), seen_values = values.slice(2, 0, end);
  at::Tensor visible;
  if (mask.has_value()) {
    visible = *mask;
  } else {  // the cache, then the new rows causally
    visible = at::ones({1, 1, rows, end}, keys.options().dtype(at::kBool));
    visible.narrow(-1, start, rows).copy_(at::ones({rows, rows}, visible.options()).tril());
  }
  // layers.attend: query heads sharing a key/value head become rows of one attention, the mask repeated for each.
  const int64_t kv_heads = shape.kv_heads, groups = heads / kv_heads;
  at::Tensor attended;
  if (groups == 1) {
    attended = at::scaled_dot_product_attention(q, seen_keys, seen_values, visible);
  } else {
    const at::Tensor grouped = q.reshape({1, kv_heads, groups * rows, head_dim});
    const at::Tensor repeated = visible.unsqueeze(2).expand({-1, -1, groups, -1, -1}).flatten(2, 3);
    attended = at::scaled_dot_product_attention(grouped, seen_keys, seen_values, repeated).view({1, heads, rows, head_dim});
  }
  const at::Tensor after = h + project(w, {O}, attended.transpose(1, 2).reshape({1, rows, -1}), int8);
  const at::Tensor gate_up = project(w, {GATE, UP}, rms_norm(after, w.norms[PRE_MLP], eps), int8);
  const at::Tensor out = after + project(w, {DOWN}, gated(gate_up, false), int8);
  if (!logits) return {out, std::nullopt};
  const at::Tensor last = out.narrow(1, rows - 1, 1);
  return {out, linear(lm_head, rms_norm(last, final_norm, eps), int8).reshape({-1})};
}

}  // namespace eagle_cpu
