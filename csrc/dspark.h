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

// The drafter pass's fused CPU ops (draft_ops.cpp; references in kernels/draft_ops.py), float32.
// q [L, H * D] (q_proj's rows), q_norm [D], keys / values [1, Hkv, Lk, D] (any strides), inv_freq
// [D / 2] -> [L, H * D]: RMS-norm each head of q, RoPE it at position + row (pairs i, i + D/2),
// attend over every key (no mask) with `scale`.
mx::array draft_attention(const mx::array& q, const mx::array& q_norm, const mx::array& keys,
                          const mx::array& values, const mx::array& inv_freq, int num_heads, int position,
                          float scale, float eps, mx::StreamOrDevice s = {});
// silu(gate) * up, one shape.
mx::array silu_mul(const mx::array& gate, const mx::array& up, mx::StreamOrDevice s = {});
// x * rsqrt(mean(x^2, last axis) + eps) (* weight [D]), float32, x's shape.
mx::array draft_rms_norm(const mx::array& x, const std::optional<mx::array>& weight, float eps,
                         mx::StreamOrDevice s = {});
// logits [k, Vd], w1 [V, r], w2 [Vd, r], vocab_ids [Vd] or none, anchor (one id) -> tokens [k] int32:
// t_j = ids[argmax(logits_j + w2 . w1[t_{j-1}])], t_{-1} = anchor.
mx::array markov_greedy(const mx::array& logits, const mx::array& w1, const mx::array& w2,
                        const std::optional<mx::array>& vocab_ids, const mx::array& anchor,
                        mx::StreamOrDevice s = {});
// The instruction set draft_ops picked for this process: "avx2" or "portable".
const char* draft_ops_isa();

// A drafter's linear layer from float16 weight panels (kernels/draft_linear.py packs them): x [M, K]
// float32, panels [ceil(n / 16), K, 16] float16 (weight row 16p + c is column c of panel p), bias [n]
// or none -> [M, n] float32.
mx::array draft_linear(const mx::array& x, const mx::array& panels, const std::optional<mx::array>& bias, int n,
                       mx::StreamOrDevice s = {});
// The instruction set draft_linear picked for this process: "avx2" or "portable".
const char* draft_linear_isa();

class DraftLinear : public mx::Primitive {
 public:
  DraftLinear(mx::Stream stream, bool has_bias) : mx::Primitive(stream), has_bias_(has_bias) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "DsparkDraftLinear"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return has_bias_ == static_cast<const DraftLinear&>(other).has_bias_;
  }

 private:
  bool has_bias_;
};

class DraftAttention : public mx::Primitive {
 public:
  DraftAttention(mx::Stream stream, int num_heads, int position, float scale, float eps)
      : mx::Primitive(stream), num_heads_(num_heads), position_(position), scale_(scale), eps_(eps) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "DsparkDraftAttention"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const DraftAttention&>(other);
    return num_heads_ == o.num_heads_ && position_ == o.position_ && scale_ == o.scale_ && eps_ == o.eps_;
  }

 private:
  int num_heads_, position_;
  float scale_, eps_;
};

class SiluMul : public mx::Primitive {
 public:
  explicit SiluMul(mx::Stream stream) : mx::Primitive(stream) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "DsparkSiluMul"; }
  bool is_equivalent(const mx::Primitive& other) const override { return true; }
};

class DraftRmsNorm : public mx::Primitive {
 public:
  DraftRmsNorm(mx::Stream stream, float eps, bool has_weight)
      : mx::Primitive(stream), eps_(eps), has_weight_(has_weight) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "DsparkRmsNorm"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const DraftRmsNorm&>(other);
    return eps_ == o.eps_ && has_weight_ == o.has_weight_;
  }

 private:
  float eps_;
  bool has_weight_;
};

// RoPE of a target's queries or keys on the CPU (float32), as mx.fast.rope with a base: x [..., L, D],
// offset int32 [] or [x.shape(0)]; row l of batch b at position offset[b] + l, its first `dims` features
// rotated (pairs (i, i + dims/2), or (2i, 2i + 1) when traditional) by (position * scale) * base^(-2i/dims).
mx::array target_rope(const mx::array& x, const mx::array& offset, int dims, bool traditional, float base,
                      float scale, mx::StreamOrDevice s = {});

class TargetRope : public mx::Primitive {
 public:
  TargetRope(mx::Stream stream, int dims, bool traditional, float base, float scale)
      : mx::Primitive(stream), dims_(dims), traditional_(traditional), base_(base), scale_(scale) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "DsparkTargetRope"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const TargetRope&>(other);
    return dims_ == o.dims_ && traditional_ == o.traditional_ && base_ == o.base_ && scale_ == o.scale_;
  }

 private:
  int dims_;
  bool traditional_;
  float base_, scale_;
};

class MarkovGreedy : public mx::Primitive {
 public:
  MarkovGreedy(mx::Stream stream, bool has_ids) : mx::Primitive(stream), has_ids_(has_ids) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "DsparkMarkovGreedy"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return has_ids_ == static_cast<const MarkovGreedy&>(other).has_ids_;
  }

 private:
  bool has_ids_;
};

// Width-invariant causal attention on the CPU (invariant_attention.cpp), float32: q [B, H, Lq, D],
// k / v [B, Hkv, Lk, D] (any strides); query row i at position Lk - Lq + i -> [B, H, Lq, D].
mx::array invariant_attention_cpu(const mx::array& q, const mx::array& k, const mx::array& v, float scale,
                                  mx::StreamOrDevice s = {});

class InvariantAttention : public mx::Primitive {
 public:
  InvariantAttention(mx::Stream stream, float scale) : mx::Primitive(stream), scale_(scale) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "DsparkInvariantAttention"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return scale_ == static_cast<const InvariantAttention&>(other).scale_;
  }

 private:
  float scale_;
};

// Row argmax in mx.argmax order (NaN first, then the larger value, then the smaller index).
int32_t argmax_row(const void* row, mx::Dtype dtype, int64_t V);

}  // namespace dspark
