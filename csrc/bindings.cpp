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
  m.attr("primitives") = nb::make_tuple("DsparkGreedyAccept", "DsparkSamplingAccept", "DsparkInvariantLinear",
                                  "DsparkDraftAttention", "DsparkDraftLinear", "DsparkRmsNorm", "DsparkSiluMul",
                                  "DsparkMarkovGreedy", "DsparkTargetRope",
                                  "DsparkInvariantAttention");

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
  m.def("draft_attention", &dspark::draft_attention, "q"_a, "q_norm"_a, "keys"_a, "values"_a, "inv_freq"_a,
        nb::kw_only(), "num_heads"_a, "position"_a, "scale"_a, "eps"_a, "stream"_a = nb::none(),
        "A drafter block's attention on the CPU: q-norm, RoPE and attention over every key, out "
        "[L, num_heads * head_dim]; see mlx_dspark.kernels.draft_ops.");
  m.def("draft_linear", &dspark::draft_linear, "x"_a, "panels"_a, "bias"_a.none(), nb::kw_only(), "n"_a,
        "stream"_a = nb::none(),
        "A drafter's x @ W.T (+ bias) on the CPU from float16 weight panels: [M, n] float32; see "
        "mlx_dspark.kernels.draft_linear.");
  m.def("silu_mul", &dspark::silu_mul, "gate"_a, "up"_a, nb::kw_only(), "stream"_a = nb::none(),
        "silu(gate) * up on the CPU (float32); see mlx_dspark.kernels.draft_ops.");
  m.def("rms_norm", &dspark::draft_rms_norm, "x"_a, "weight"_a.none(), nb::kw_only(), "eps"_a,
        "stream"_a = nb::none(),
        "RMS norm over the last axis on the CPU (float32; weight or none); see mlx_dspark.kernels.draft_ops.");
  m.def("rope", &dspark::target_rope, "x"_a, "offset"_a, nb::kw_only(), "dims"_a, "traditional"_a, "base"_a,
        "scale"_a, "stream"_a = nb::none(),
        "A target's RoPE on the CPU (float32), as mx.fast.rope with a base; see mlx_dspark.kernels.target_ops.");
  m.def("markov_greedy", &dspark::markov_greedy, "logits"_a, "w1"_a, "w2"_a, "vocab_ids"_a.none(), "anchor"_a,
        nb::kw_only(), "stream"_a = nb::none(),
        "The Markov head's greedy chain on the CPU: tokens [k] int32; see mlx_dspark.kernels.draft_ops.");
  m.def("invariant_attention", &dspark::invariant_attention_cpu, "q"_a, "k"_a, "v"_a, nb::kw_only(), "scale"_a,
        "stream"_a = nb::none(),
        "Width-invariant causal attention on the CPU (float32): a verify row equals the plain step at "
        "its position, bitwise; see mlx_dspark.kernels.invariant.");
  m.def("draft_ops_isa", &dspark::draft_ops_isa,
        "The instruction set of the CPU draft ops in this process: 'avx2' or 'portable'.");
  m.def("draft_linear_isa", &dspark::draft_linear_isa,
        "The instruction set of the CPU draft linear's tiles in this process: 'avx2' or 'portable'.");
  m.def("invariant_linear_isa", &dspark::invariant_linear_isa,
        "The instruction set of the CPU invariant linear's tiles in this process: 'avx2' or 'portable'.");
}
