// The two whole forwards' weights (forward.cpp), handed by name once, when a model is built: the names in one table
// here, and every weight checked against the model's dimensions then, so that a misnamed or misshaped one is refused,
// by its name and its layer's, before any call.
#include "kernels.h"

#include <map>

namespace eagle_cpu {
namespace {

// The names of a layer's weights: its norms, then each projection's parts as <projection>.<part>.
constexpr std::array<const char*, NORMS> NORM_NAMES{"input_norm",    "post_attention_norm", "pre_mlp_norm",
                                                    "post_mlp_norm", "q_norm",              "k_norm"};
constexpr std::array<const char*, PROJECTIONS> PROJECTION_NAMES{"q", "k", "v", "o", "gate", "up", "down"};
constexpr std::array<const char*, 5> GROUP_PARTS{"codes", "scales", "mins", "block_scales", "block_mins"};
constexpr const char* BIAS = "bias";
const std::string LAYERS = "layers.";  // a decoder's layer i's weights are named layers.<i>.<name>

// Weights handed by name to one part of a model (a decoder layer, what surrounds them, a head), and what errors call
// that part ("decoder layer 3").
class Scope {
 public:
  Scope(std::string label, std::map<std::string, at::Tensor> named)
      : label_(std::move(label)), named_(std::move(named)) {}

  // Refuses a weight whose name is not one of `known` (a misnamed one), before anything else so that the error names
  // it; `described`: those names in short, for the error.
  void only(const std::vector<std::string>& known, const std::string& described) const {
    for (const auto& item : named_)
      TORCH_CHECK(std::find(known.begin(), known.end(), item.first) != known.end(), label_, ": no weight is named '",
                  item.first, "' (", described, ")");
  }

  // The weight `name`, or an undefined tensor where none was handed.
  at::Tensor optional(const std::string& name) const {
    const auto found = named_.find(name);
    return found == named_.end() ? at::Tensor() : found->second;
  }

  at::Tensor required(const std::string& name) const {
    const at::Tensor t = optional(name);
    TORCH_CHECK(t.defined(), label_, ": weight '", name, "' is missing");
    return t;
  }

  // Checks that `t` (the weight `name`) is contiguous, of one of `types` and of `shape`.
  void expect(const std::string& name, const at::Tensor& t, const std::vector<int64_t>& shape,
              std::initializer_list<at::ScalarType> types) const {
    const bool typed = std::find(types.begin(), types.end(), t.scalar_type()) != types.end();
    std::string wanted;
    for (const at::ScalarType type : types) wanted += (wanted.empty() ? "" : " or ") + std::string(c10::toString(type));
    TORCH_CHECK(t.sizes() == at::IntArrayRef(shape) && typed, label_, ": weight '", name, "' is ", t.scalar_type(),
                " ", t.sizes(), ", expected ", wanted, " ", at::IntArrayRef(shape));
    TORCH_CHECK(t.is_contiguous(), label_, ": weight '", name, "' is not contiguous");
  }

  void absent(const std::string& name, const char* why) const {
    TORCH_CHECK(!optional(name).defined(), label_, ": weight '", name, "': ", why);
  }

  const std::string& label() const { return label_; }

 private:
  std::string label_;
  std::map<std::string, at::Tensor> named_;
};

std::map<std::string, at::Tensor> as_map(const NamedWeights& weights) {
  std::map<std::string, at::Tensor> named;
  for (const auto& item : weights) named.emplace(item.key(), item.value());
  return named;
}

std::string joined(const std::vector<std::string>& items) {
  std::string out;
  for (const std::string& item : items) out += (out.empty() ? "" : ", ") + item;
  return out;
}

// The names `linears`' weights take, in short: "{q, k}.{codes, scales, ...}".
std::string described(const std::vector<std::string>& linears, bool with_bias) {
  std::vector<std::string> parts(GROUP_PARTS.begin(), GROUP_PARTS.end());
  if (with_bias) parts.push_back(BIAS);
  return "{" + joined(linears) + "}.{" + joined(parts) + "}";
}

// The names a linear layer's weights take: its groups' parts, then its bias where it may have one.
std::vector<std::string> linear_names(const std::string& name, bool with_bias) {
  std::vector<std::string> names;
  for (const char* part : GROUP_PARTS) names.push_back(name + "." + part);
  if (with_bias) names.push_back(name + "." + BIAS);
  return names;
}

// The linear layer `name` of `in` -> `out` features, as the float kernels or the int8 ones (engine/model/quant.py
// repack) hold its groups: [out, in / 2] Q4_1 codes with mins or [out, in] Q8_0 ones, float32 scales a group; or
// [tiles, groups, chunks, 16, 4] codes with the scales (two a group, or with a K-quant's block factors) that
// int8_layer reads.
Linear linear_of(const Scope& scope, const std::string& name, int64_t out, int64_t in, bool int8) {
  const auto part = [&](const char* p) { return name + "." + p; };
  Linear w;
  w.out_features = out;
  w.codes = scope.required(part("codes"));
  w.scales = scope.required(part("scales"));
  w.mins = scope.optional(part("mins"));
  w.block_scales = scope.optional(part("block_scales"));
  w.block_mins = scope.optional(part("block_mins"));
  w.bias = scope.optional(part(BIAS));
  TORCH_CHECK(in % GROUP == 0, scope.label(), ": ", name, " takes ", in, " inputs, not groups of ", GROUP);
  const bool four_bit = w.codes.scalar_type() == at::kByte;
  const int64_t groups = in / GROUP;
  if (int8) {
    const int64_t tiles = (out + LANES - 1) / LANES;
    scope.expect(part("codes"), w.codes, {tiles, groups, four_bit ? 4 : 8, LANES, 4}, {at::kByte, at::kChar});
    const std::vector<int64_t> scales = w.scales.dim() == 4 ? std::vector<int64_t>{tiles, groups, 2, LANES}
                                                             : std::vector<int64_t>{tiles, groups, LANES};
    scope.expect(part("scales"), w.scales, scales, {at::kHalf, at::kFloat, at::kChar});
    if (w.mins.defined()) scope.expect(part("mins"), w.mins, {tiles, groups, LANES}, {w.scales.scalar_type()});
    if (w.block_scales.defined())
      scope.expect(part("block_scales"), w.block_scales, {tiles, groups / 8, LANES}, {at::kHalf});
    if (w.block_mins.defined())
      scope.expect(part("block_mins"), w.block_mins, {tiles, groups / 8, LANES}, {at::kHalf});
    try {  // what goes with what (mins with 4-bit codes, int8 scales with block factors), as the kernels read them
      int8_layer(w, in);
    } catch (const c10::Error& error) {
      TORCH_CHECK(false, scope.label(), ": ", name, ": ", error.msg());
    }
  } else {
    scope.expect(part("codes"), w.codes, {out, four_bit ? in / 2 : in}, {at::kByte, at::kChar});
    scope.expect(part("scales"), w.scales, {out, groups}, {at::kFloat});
    if (four_bit) scope.expect(part("mins"), scope.required(part("mins")), {out, groups}, {at::kFloat});
    else scope.absent(part("mins"), "Q8_0 groups have no mins");
    scope.absent(part("block_scales"), "the float kernels take Q4_1 and Q8_0 groups only");
    scope.absent(part("block_mins"), "the float kernels take Q4_1 and Q8_0 groups only");
  }
  if (w.bias.defined()) scope.expect(part(BIAS), w.bias, {out}, {at::kFloat});
  return w;
}

// A norm's weight of `width`: required, or undefined where the model has none there.
at::Tensor norm_of(const Scope& scope, const std::string& name, int64_t width, bool required) {
  const at::Tensor t = required ? scope.required(name) : scope.optional(name);
  if (t.defined()) scope.expect(name, t, {width}, {at::kFloat});
  return t;
}

const std::vector<std::string> PROJECTION_LIST(PROJECTION_NAMES.begin(), PROJECTION_NAMES.end());

// The names of a layer's weights (its norms that `norms` lists, each projection's), and those names in short.
std::pair<std::vector<std::string>, std::string> layer_names(const std::vector<Norm>& norms) {
  std::vector<std::string> names;
  for (const Norm n : norms) names.push_back(NORM_NAMES[n]);
  const std::string short_names = joined(names) + ", " + described(PROJECTION_LIST, true);
  for (const std::string& projection : PROJECTION_LIST)
    for (const std::string& name : linear_names(projection, true)) names.push_back(name);
  return {names, short_names};
}

// A layer whose q, k and v take `in` features: the norms of `norms` (INPUT and PRE_MLP required) and projections of
// `shape`'s dimensions.
Layer layer_of(const Scope& scope, const Shape& shape, int64_t in, const std::vector<Norm>& norms, bool int8) {
  Layer layer;
  for (const Norm n : norms) {
    const int64_t width = n == Q_NORM || n == K_NORM ? shape.head_dim : shape.hidden;
    layer.norms[n] = norm_of(scope, NORM_NAMES[n], width, n == INPUT || n == PRE_MLP);
  }
  const int64_t q = shape.heads * shape.head_dim, kv = shape.kv_heads * shape.head_dim;
  const std::array<std::pair<int64_t, int64_t>, PROJECTIONS> sizes{{{q, in}, {kv, in}, {kv, in}, {shape.hidden, q},
                                                                    {shape.intermediate, shape.hidden},
                                                                    {shape.intermediate, shape.hidden},
                                                                    {shape.hidden, shape.intermediate}}};
  for (int p = 0; p < PROJECTIONS; ++p)
    layer.projections[p] = linear_of(scope, PROJECTION_NAMES[p], sizes[p].first, sizes[p].second, int8);
  return layer;
}

// The dimensions `names`, each given and none negative, and no other.
std::map<std::string, int64_t> dimensions_of(const Dimensions& given, const std::vector<std::string>& names,
                                             const char* model) {
  std::map<std::string, int64_t> found;
  for (const auto& item : given) {
    TORCH_CHECK(std::find(names.begin(), names.end(), item.key()) != names.end(), model, ": no dimension is named '",
                item.key(), "'");
    found.emplace(item.key(), item.value());
  }
  for (const std::string& name : names)
    TORCH_CHECK(found.count(name) && found[name] >= 0, model, ": dimension '", name, "' is missing or negative");
  return found;
}

Shape shape_of(const std::map<std::string, int64_t>& d) {
  return {d.at("hidden"), d.at("heads"), d.at("kv_heads"), d.at("head_dim"), d.at("intermediate")};
}

const std::vector<Norm> ALL_NORMS{INPUT, POST_ATTENTION, PRE_MLP, POST_MLP, Q_NORM, K_NORM};
// An EAGLE-3 head's layer norms its token embeddings (INPUT) and, after attention, the MLP's input (PRE_MLP).
const std::vector<Norm> HEAD_NORMS{INPUT, PRE_MLP};
const std::vector<std::string> SHAPE{"hidden", "heads", "kv_heads", "head_dim", "intermediate"};

// A decoder's weights by layer (layers.<i>.<name> as <name> in the i-th map), and the others in the last.
std::vector<std::map<std::string, at::Tensor>> by_layer(const NamedWeights& weights, int64_t layers) {
  std::vector<std::map<std::string, at::Tensor>> split(layers + 1);
  for (const auto& item : weights) {
    const std::string& name = item.key();
    if (name.rfind(LAYERS, 0) != 0) {
      split[layers].emplace(name, item.value());
      continue;
    }
    const size_t dot = name.find('.', LAYERS.size());
    const std::string index = name.substr(LAYERS.size(), dot - LAYERS.size());
    TORCH_CHECK(dot != std::string::npos && !index.empty() && index.size() < 10 &&
                    index.find_first_not_of("0123456789") == std::string::npos,
                "decoder: weight '", name, "' is not named layers.<i>.<name>");
    const int64_t layer = std::stoll(index);
    TORCH_CHECK(layer < layers, "decoder: weight '", name, "' of layer ", layer, ", of ", layers);
    split[layer].emplace(name.substr(dot + 1), item.value());
  }
  return split;
}

}  // namespace

Int8Layer int8_layer(const Linear& w, int64_t in_features) {
  return int8_layer(w.codes, w.scales, maybe(w.mins), maybe(w.block_scales), maybe(w.block_mins), w.out_features,
                    in_features);
}

Decoder::Decoder(const Dimensions& dimensions, double eps, double scale, bool gelu, bool int8,
                 const c10::List<bool>& sliding, const NamedWeights& weights)
    : eps(eps), scale(scale), gelu(gelu), int8(int8), sliding(sliding.begin(), sliding.end()) {
  shape = shape_of(dimensions_of(dimensions, SHAPE, "decoder"));
  const int64_t count = static_cast<int64_t>(this->sliding.size());
  std::vector<std::map<std::string, at::Tensor>> split = by_layer(weights, count);
  const Scope outside("decoder", std::move(split.back()));
  outside.only({"final_norm"}, "final_norm, and each layer's as layers.<i>.<name>");
  const auto [names, short_names] = layer_names(ALL_NORMS);
  for (int64_t i = 0; i < count; ++i) {
    const Scope scope("decoder layer " + std::to_string(i), std::move(split[i]));
    scope.only(names, "a layer's: " + short_names);
    layers.push_back(layer_of(scope, shape, shape.hidden, ALL_NORMS, int8));
  }
  final_norm = norm_of(outside, "final_norm", shape.hidden, true);
}

Eagle3Head::Eagle3Head(const Dimensions& dimensions, double eps, bool int8, const NamedWeights& weights)
    : eps(eps), int8(int8) {
  std::vector<std::string> names = SHAPE;
  names.insert(names.end(), {"features", "vocab", "draft_vocab"});
  const std::map<std::string, int64_t> d = dimensions_of(dimensions, names, "EAGLE-3 head");
  shape = shape_of(d);
  features = d.at("features"), vocab = d.at("vocab"), draft_vocab = d.at("draft_vocab");
  const Scope scope("EAGLE-3 head", as_map(weights));
  auto [known, short_names] = layer_names(HEAD_NORMS);
  const std::vector<std::string> others{"hidden_norm", "final_norm", "embedding.scale"};
  const std::vector<std::string> linears{"fc", "lm_head", "embedding"};
  known.insert(known.end(), others.begin(), others.end());
  for (const std::string& linear : linears)
    for (const std::string& name : linear_names(linear, false)) known.push_back(name);
  scope.only(known, short_names + ", " + joined(others) + ", " + described(linears, false));
  // q, k and v read the normed token embeddings and hidden states side by side
  layer = layer_of(scope, shape, 2 * shape.hidden, HEAD_NORMS, int8);
  hidden_norm = norm_of(scope, "hidden_norm", shape.hidden, true);
  final_norm = norm_of(scope, "final_norm", shape.hidden, true);
  fc = linear_of(scope, "fc", shape.hidden, features, int8);
  lm_head = linear_of(scope, "lm_head", draft_vocab, shape.hidden, int8);
  if (scope.optional("embedding.codes").defined()) {  // the base's table on the int8 layout, whatever the head's
    embedding = linear_of(scope, "embedding", vocab, shape.hidden, true);
    embedding_scale = scope.optional("embedding.scale");
    const at::Tensor& scale = embedding_scale;
    TORCH_CHECK(!scale.defined() || (scale.numel() == 1 && scale.scalar_type() == at::kFloat),
                "EAGLE-3 head: weight 'embedding.scale' is ", scale.scalar_type(), " ", scale.sizes(),
                ", expected one float32");
  } else {
    scope.absent("embedding.scale", "a scale without the table's codes");
  }
}

}  // namespace eagle_cpu
