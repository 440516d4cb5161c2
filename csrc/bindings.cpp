// mlx_dspark._ext: nanobind bindings of the native primitives (domain "mlx", so mx.array and
// streams pass straight through to MLX's own bindings).
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include "dspark.h"
#include "mlx/version.h"

namespace nb = nanobind;
using namespace nb::literals;

#ifndef DSPARK_SOURCE_HASH
#define DSPARK_SOURCE_HASH ""
#endif
#ifndef DSPARK_METALLIB
#define DSPARK_METALLIB 0
#endif

NB_MODULE(_ext, m) {
  m.doc() = "mlx-dspark native kernels (MLX primitives)";
  m.attr("mlx_version") = mlx::core::version();
  m.attr("has_metal") = DSPARK_METALLIB != 0;
  m.attr("source_hash") = DSPARK_SOURCE_HASH;
  m.attr("primitives") = nb::make_tuple("DsparkGreedyAccept", "DsparkSamplingAccept", "DsparkInvariantLinear");

  m.def("greedy_accept", &dspark::greedy_accept, "logits"_a, "draft"_a, nb::kw_only(),
        "stream"_a = nb::none(),
        "Greedy verify-and-accept: (target [B, w], accepted [B], bonus [B]) int32; see "
        "mlx_dspark.kernels.greedy_accept.");
  m.def("sampling_accept", &dspark::sampling_accept, "p"_a, "q"_a.none(), "draft"_a, "u"_a,
        "u_bonus"_a, nb::kw_only(), "stream"_a = nb::none(),
        "Speculative-sampling accept: (accepted [B], bonus [B]) int32; see "
        "mlx_dspark.kernels.sampling_accept.");
  m.def("invariant_linear", &dspark::invariant_linear, "x"_a, "weight"_a, "bias"_a.none(), nb::kw_only(),
        "kernel"_a = "tiled", "stream"_a = nb::none(),
        "Width-invariant x @ weight.T (+ bias) on the CPU: row m of an M-row call equals the row alone, "
        "bitwise; kernel 'tiled' (register tiles, the default) or 'rows' (the first kernel, one x row "
        "at a time: a benchmark baseline); see mlx_dspark.kernels.invariant_linear.");
  m.def("invariant_linear_isa", &dspark::invariant_linear_isa,
        "The instruction set of the CPU invariant linear's tiles in this process: 'avx2' or 'portable'.");
}
