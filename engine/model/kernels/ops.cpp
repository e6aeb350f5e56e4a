// The switches between the instruction-set paths, and the kernels' registration as torch.ops.eagle_cpu, with the
// two whole forwards as torch.classes.eagle_cpu.Decoder and Eagle3Head.
// GCC 12 warns (-Wstringop-overflow) inside torch's IValue code that the classes' registration instantiates: a false
// positive on the undefined tensor's shared instance, in torch's headers, where only a pragma before them reaches.
#pragma GCC diagnostic ignored "-Wstringop-overflow"
#include "kernels.h"

#include <torch/library.h>

namespace eagle_cpu {

namespace {

bool cpu_has_avx512() {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq");
  return has;
}

bool cpu_has_vnni() {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vnni");
  return has;
}

}  // namespace

bool use_wide = cpu_has_avx512();  // eagle_cpu::set_wide turns it off for tests
bool use_vnni = cpu_has_vnni();    // eagle_cpu::set_vnni turns it off for tests

namespace {

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

}  // namespace
}  // namespace eagle_cpu

TORCH_LIBRARY(eagle_cpu, m) {
  m.def("set_wide(bool wide) -> bool", &eagle_cpu::set_wide);
  m.def("set_vnni(bool vnni) -> bool", &eagle_cpu::set_vnni);
  m.def("int8_linear(Tensor x, Tensor codes, Tensor scales, Tensor? mins, Tensor? block_scales, Tensor? block_mins, "
        "Tensor? bias, int out_features) -> Tensor");
  m.def("int8_rows(Tensor ids, Tensor codes, Tensor scales, Tensor? mins, Tensor? block_scales, Tensor? block_mins, "
        "int out_features) -> Tensor");
  m.def("q4_1_linear(Tensor x, Tensor codes, Tensor scales, Tensor mins, Tensor? bias) -> Tensor");
  m.def("q8_0_linear(Tensor x, Tensor codes, Tensor scales, Tensor? bias) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("torch_sum_lanes() -> int", &eagle_cpu::torch_sum_lanes);
  m.def("attention(Tensor query, Tensor key, Tensor value, Tensor? mask, float scale) -> Tensor");
  m.class_<eagle_cpu::Decoder>("Decoder")
      .def(torch::init<const eagle_cpu::Dimensions&, double, double, bool, bool, const c10::List<bool>&,
                       const eagle_cpu::NamedWeights&>(),
           "", {torch::arg("dimensions"), torch::arg("eps"), torch::arg("scale"), torch::arg("gelu"),
                torch::arg("int8"), torch::arg("sliding"), torch::arg("weights")})
      .def("forward", &eagle_cpu::Decoder::forward, "",
           {torch::arg("embeddings"), torch::arg("rotary"), torch::arg("mask"), torch::arg("sliding_mask"),
            torch::arg("caches"), torch::arg("start"), torch::arg("capture")});
  m.class_<eagle_cpu::Eagle3Head>("Eagle3Head")
      .def(torch::init<const eagle_cpu::Dimensions&, double, bool, const eagle_cpu::NamedWeights&>(), "",
           {torch::arg("dimensions"), torch::arg("eps"), torch::arg("int8"), torch::arg("weights")})
      .def("set_rotary", &eagle_cpu::Eagle3Head::set_rotary, "", {torch::arg("cos"), torch::arg("sin")})
      .def("forward", &eagle_cpu::Eagle3Head::forward, "",
           {torch::arg("hidden"), torch::arg("tokens"), torch::arg("positions"), torch::arg("mask"),
            torch::arg("cache"), torch::arg("from_target"), torch::arg("logits")});
}

TORCH_LIBRARY_IMPL(eagle_cpu, CPU, m) {
  m.impl("q4_1_linear", &eagle_cpu::q4_1_linear);
  m.impl("q8_0_linear", &eagle_cpu::q8_0_linear);
  m.impl("int8_linear", &eagle_cpu::int8_linear);
  m.impl("int8_rows", &eagle_cpu::int8_rows);
  m.impl("rms_norm", &eagle_cpu::rms_norm);
  m.impl("attention", &eagle_cpu::attention);
}
