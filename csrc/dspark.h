// mlx-dspark native kernels: MLX primitives with eval_cpu (C++) and eval_gpu (Metal, macOS).
// Semantics are defined by the pure-MLX references in python/mlx_dspark/kernels/reference.py.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace mx = mlx::core;

namespace dspark {

// Launch shapes of the GPU kernels (kept equal to kernels/gpu_source.py).
constexpr int kGaThreads = 256;   // greedy accept: threads per threadgroup
constexpr int kGaChunk = 4096;    // greedy accept: elements of V per threadgroup in pass 1
constexpr int kGaMaxW = 128;      // DS_GA_MAX_W: widest verify block on the GPU
constexpr int kSaThreads = 1024;  // sampling accept: threads per threadgroup

// Greedy verify-and-accept. logits [B, w, V] (float32/float16/bfloat16), draft [B, w-1] int32
// -> {target [B, w], accepted [B], bonus [B]} int32.
std::vector<mx::array> greedy_accept(const mx::array& logits, const mx::array& draft,
                                     mx::StreamOrDevice s = {});

// Speculative-sampling accept. p [B, w, V] float32, q [B, w-1, V] float32 or none,
// draft [B, w-1] int32, u [B, w-1] float32, u_bonus [B] float32 -> {accepted [B], bonus [B]}.
std::vector<mx::array> sampling_accept(const mx::array& p, const std::optional<mx::array>& q,
                                       const mx::array& draft, const mx::array& u,
                                       const mx::array& u_bonus, mx::StreamOrDevice s = {});

class GreedyAccept : public mx::Primitive {
 public:
  explicit GreedyAccept(mx::Stream stream) : mx::Primitive(stream) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "DsparkGreedyAccept"; }
  bool is_equivalent(const mx::Primitive& other) const override { return true; }
};

class SamplingAccept : public mx::Primitive {
 public:
  SamplingAccept(mx::Stream stream, bool has_q) : mx::Primitive(stream), has_q_(has_q) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "DsparkSamplingAccept"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return has_q_ == static_cast<const SamplingAccept&>(other).has_q_;
  }
  bool has_q() const { return has_q_; }

 private:
  bool has_q_;
};

// Width-invariant dense linear on the CPU: x [M, K], weight [N, K], bias [N] or none, all one float
// dtype -> [M, N]; row m of an M-row call is bit-identical to the row alone (invariant_linear.cpp).
// kernel: "tiled" (register tiles, the default) or "rows" (the first kernel, a benchmark baseline).
mx::array invariant_linear(const mx::array& x, const mx::array& weight, const std::optional<mx::array>& bias,
                           const std::string& kernel = "tiled", mx::StreamOrDevice s = {});

constexpr int kKernelTiled = 0, kKernelRows = 1;

// The instruction set the tiled kernel picked for this process: "avx2" or "portable".
const char* invariant_linear_isa();

class InvariantLinear : public mx::Primitive {
 public:
  InvariantLinear(mx::Stream stream, bool has_bias, int kernel)
      : mx::Primitive(stream), has_bias_(has_bias), kernel_(kernel) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "DsparkInvariantLinear"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const InvariantLinear&>(other);
    return has_bias_ == o.has_bias_ && kernel_ == o.kernel_;
  }

 private:
  bool has_bias_;
  int kernel_;
};

// Row argmax in mx.argmax order (NaN first, then the larger value, then the smaller index).
int32_t argmax_row(const void* row, mx::Dtype dtype, int64_t V);

}  // namespace dspark
