// The drafter pass's small ops on the CPU, each fused into one primitive with a vectorised exp.
// Semantics: python/mlx_dspark/kernels/draft_ops.py (the pure-MLX references).
//
// Why: MLX's CPU build evaluates exp one float at a time (~20 ns an element on x86), and a drafter
// pass is a chain of small ops over a handful of rows, so the softmax of its attention, its SiLU
// and its sequential Markov chain cost more than its products (bench/results/drafter-pass-cpu.md).
//   draft_attention   q-norm, RoPE and non-causal attention of a block's query rows over the
//                     drafter's keys/values (any strides), out in o_proj's input layout.
//   silu_mul          silu(gate) * up.
//   rms_norm          x * rsqrt(mean(x^2) + eps) * weight over the last axis (MLX's CPU build runs
//                     mx.fast.rms_norm as ~7 ops; a pass has 17 norms: ~1.7 ms of its ~8).
//   markov_greedy     the Markov head's greedy chain: token_j = ids[argmax(U_j + W2 W1[prev])],
//                     prev = token_j, for every slot in one op.
// Drafts need no exactness (the target verifies each), so the exp is a polynomial one; the
// references agree to float32 rounding of that exp (tests/test_draft_ops.py).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <sstream>
#include <stdexcept>
#include <vector>

#include "dspark.h"
#include "cpu_pool.h"
#include "cpu_vec.h"

namespace dspark {

using namespace cpu;

const char* draft_ops_isa() { return vec().name; }

// ------------------------------------------------------------------------------ draft_attention
mx::array draft_attention(const mx::array& q, const mx::array& q_norm, const mx::array& keys,
                          const mx::array& values, const mx::array& inv_freq, int num_heads, int position,
                          float scale, float eps, mx::StreamOrDevice s) {
  constexpr const char* op = "draft_attention";
  auto st = cpu_stream(op, s);
  for (auto* a : {&q, &q_norm, &keys, &values, &inv_freq}) need_f32(op, *a, "every input");
  if (keys.ndim() != 4 || keys.shape(0) != 1 || values.shape() != keys.shape())
    fail(op, "keys and values must be [1, kv_heads, L_k, head_dim], the same shape");
  const int nkv = keys.shape(1), hd = keys.shape(3);
  if (num_heads < 1 || num_heads % nkv != 0) fail(op, "num_heads must be a multiple of the kv heads");
  if (hd % 2 != 0) fail(op, "head_dim must be even");
  if (q.ndim() != 2 || q.shape(1) != num_heads * hd) {
    std::ostringstream m;
    m << "q must be [L, num_heads * head_dim] = [L, " << num_heads * hd << "]";
    fail(op, m.str());
  }
  if (q_norm.ndim() != 1 || q_norm.shape(0) != hd) fail(op, "q_norm must be [head_dim]");
  if (inv_freq.ndim() != 1 || inv_freq.shape(0) != hd / 2) fail(op, "inv_freq must be [head_dim / 2]");
  std::vector<mx::array> inputs = {mx::contiguous(q, false, st), mx::contiguous(q_norm, false, st), keys, values,
                                   mx::contiguous(inv_freq, false, st)};
  return mx::array(q.shape(), mx::float32, std::make_shared<DraftAttention>(st, num_heads, position, scale, eps),
                   inputs);
}

void DraftAttention::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& out = outputs[0];
  begin(stream(), inputs, out);
  const auto& k = inputs[2];
  const auto& v = inputs[3];
  const int L = inputs[0].shape(0), nkv = k.shape(1), Lk = k.shape(2), hd = k.shape(3);
  const int64_t ks1 = k.strides()[1], ks2 = k.strides()[2], ks3 = k.strides()[3];
  const int64_t vs1 = v.strides()[1], vs2 = v.strides()[2], vs3 = v.strides()[3];
  mx::cpu::get_command_encoder(stream()).dispatch(
      [qp = inputs[0].data<float>(), wp = inputs[1].data<float>(), kp = k.data<float>(), vp = v.data<float>(),
       fp = inputs[4].data<float>(), op = out.data<float>(), L, nkv, Lk, hd, ks1, ks2, ks3, vs1, vs2, vs3,
       nh = num_heads_, pos0 = position_, scale = scale_, eps = eps_]() {
        const Vec& f = vec();
        const int half = hd / 2, rep = nh / nkv;
        // Keys/values with a unit last stride are read in place; others are gathered once.
        std::vector<float> kbuf, vbuf;
        auto rows = [&](const float* base, int64_t s1, int64_t s2, int64_t s3, std::vector<float>& buf,
                        int64_t& r1, int64_t& r2) -> const float* {
          if (s3 == 1) {
            r1 = s1, r2 = s2;
            return base;
          }
          buf.resize(static_cast<size_t>(nkv) * Lk * hd);
          for (int h = 0; h < nkv; ++h)
            for (int j = 0; j < Lk; ++j)
              for (int d = 0; d < hd; ++d)
                buf[(static_cast<size_t>(h) * Lk + j) * hd + d] = base[h * s1 + j * s2 + d * s3];
          r1 = static_cast<int64_t>(Lk) * hd, r2 = hd;
          return buf.data();
        };
        int64_t k1, k2, v1, v2;
        const float* K = rows(kp, ks1, ks2, ks3, kbuf, k1, k2);
        const float* V = rows(vp, vs1, vs2, vs3, vbuf, v1, v2);
        // RoPE's cos / sin per row, once; then one task per query head (all rows), on the pool's
        // threads where the work pays for waking them.
        std::vector<float> cs(static_cast<size_t>(L) * half), sn(static_cast<size_t>(L) * half);
        for (int l = 0; l < L; ++l) {
          const double pos = static_cast<double>(pos0 + l);
          for (int i = 0; i < half; ++i) {
            const float a = static_cast<float>(pos * static_cast<double>(fp[i]));
            cs[l * half + i] = std::cos(a), sn[l * half + i] = std::sin(a);
          }
        }
        auto head = [&](int h) {
          std::vector<float> qr(hd), sc(std::max(Lk, 1));
          const int g = h / rep;
          for (int l = 0; l < L; ++l) {
            const float* x = qp + (static_cast<int64_t>(l) * nh + h) * hd;
            const float inv = 1.0f / std::sqrt(f.dot(x, x, hd) / hd + eps);
            const float* c = cs.data() + l * half;
            const float* si = sn.data() + l * half;
            for (int i = 0; i < half; ++i) {
              const float a = x[i] * inv * wp[i], b = x[i + half] * inv * wp[i + half];
              qr[i] = (a * c[i] - b * si[i]) * scale;
              qr[i + half] = (a * si[i] + b * c[i]) * scale;
            }
            float m = -INFINITY;
            for (int j = 0; j < Lk; ++j) {
              sc[j] = f.dot(qr.data(), K + g * k1 + j * k2, hd);
              m = std::max(m, sc[j]);
            }
            float* y = op + (static_cast<int64_t>(l) * nh + h) * hd;
            std::fill(y, y + hd, 0.0f);
            if (Lk == 0) continue;
            const float denom = f.exp_shift_sum(sc.data(), m, Lk);
            for (int j = 0; j < Lk; ++j) f.axpy(sc[j] / denom, V + g * v1 + j * v2, y, hd);
          }
        };
        if (static_cast<int64_t>(L) * nh * Lk * hd >= kParallelWork) {
          parallel_for(nh, head);
        } else {
          for (int h = 0; h < nh; ++h) head(h);
        }
      });
}

// ------------------------------------------------------------------------------------ silu_mul
mx::array silu_mul(const mx::array& gate, const mx::array& up, mx::StreamOrDevice s) {
  constexpr const char* op = "silu_mul";
  auto st = cpu_stream(op, s);
  need_f32(op, gate, "gate");
  need_f32(op, up, "up");
  if (gate.shape() != up.shape()) fail(op, "gate and up must have one shape");
  return mx::array(gate.shape(), mx::float32, std::make_shared<SiluMul>(st),
                   {mx::contiguous(gate, false, st), mx::contiguous(up, false, st)});
}

void SiluMul::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& out = outputs[0];
  begin(stream(), inputs, out);
  mx::cpu::get_command_encoder(stream()).dispatch(
      [g = inputs[0].data<float>(), u = inputs[1].data<float>(), y = out.data<float>(), n = out.size()]() {
        vec().silu_mul(g, u, y, static_cast<int64_t>(n));
      });
}

// ------------------------------------------------------------------------------------ rms_norm
mx::array draft_rms_norm(const mx::array& x, const std::optional<mx::array>& weight, float eps,
                         mx::StreamOrDevice s) {
  constexpr const char* op = "rms_norm";
  auto st = cpu_stream(op, s);
  need_f32(op, x, "x");
  if (x.ndim() < 1 || x.shape(-1) < 1) fail(op, "x must have a last axis");
  std::vector<mx::array> inputs = {mx::contiguous(x, false, st)};
  if (weight) {
    need_f32(op, *weight, "weight");
    if (weight->ndim() != 1 || weight->shape(0) != x.shape(-1)) fail(op, "weight must be [x's last axis]");
    inputs.push_back(mx::contiguous(*weight, false, st));
  }
  return mx::array(x.shape(), mx::float32, std::make_shared<DraftRmsNorm>(st, eps, weight.has_value()), inputs);
}

void DraftRmsNorm::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& out = outputs[0];
  begin(stream(), inputs, out);
  const int D = inputs[0].shape(-1);
  const int64_t rows = static_cast<int64_t>(inputs[0].size() / D);
  mx::cpu::get_command_encoder(stream()).dispatch(
      [xp = inputs[0].data<float>(), wp = has_weight_ ? inputs[1].data<float>() : nullptr, y = out.data<float>(), D,
       rows, eps = eps_]() {
        const Vec& f = vec();
        for (int64_t r = 0; r < rows; ++r) {
          const float* x = xp + r * D;
          float* o = y + r * D;
          const float inv = 1.0f / std::sqrt(f.dot(x, x, D) / static_cast<float>(D) + eps);
          if (wp) {
            for (int i = 0; i < D; ++i) o[i] = x[i] * inv * wp[i];
          } else {
            for (int i = 0; i < D; ++i) o[i] = x[i] * inv;
          }
        }
      });
}

// ------------------------------------------------------------------------------- markov_greedy
mx::array markov_greedy(const mx::array& logits, const mx::array& w1, const mx::array& w2,
                        const std::optional<mx::array>& vocab_ids, const mx::array& anchor, mx::StreamOrDevice s) {
  constexpr const char* op = "markov_greedy";
  auto st = cpu_stream(op, s);
  for (auto* a : {&logits, &w1, &w2}) need_f32(op, *a, "logits, w1 and w2");
  if (logits.ndim() != 2 || w1.ndim() != 2 || w2.ndim() != 2) fail(op, "logits, w1 and w2 must be 2-D");
  const int Vd = logits.shape(1), r = w1.shape(1);
  if (w2.shape(0) != Vd || w2.shape(1) != r) fail(op, "w2 must be [logits' vocabulary, w1's rank]");
  if (vocab_ids && (vocab_ids->ndim() != 1 || vocab_ids->shape(0) != Vd))
    fail(op, "vocab_ids must be [logits' vocabulary]");
  if (!vocab_ids && Vd != w1.shape(0)) fail(op, "without vocab_ids, logits must cover w1's vocabulary");
  if (anchor.size() != 1) fail(op, "anchor must be one token id");
  std::vector<mx::array> inputs = {mx::contiguous(logits, false, st), mx::contiguous(w1, false, st),
                                   mx::contiguous(w2, false, st),
                                   mx::contiguous(mx::astype(mx::reshape(anchor, {1}, st), mx::int32, st), false, st)};
  if (vocab_ids) inputs.push_back(mx::contiguous(mx::astype(*vocab_ids, mx::int32, st), false, st));
  return mx::array({logits.shape(0)}, mx::int32, std::make_shared<MarkovGreedy>(st, vocab_ids.has_value()), inputs);
}

void MarkovGreedy::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& out = outputs[0];
  begin(stream(), inputs, out);
  const int k = inputs[0].shape(0), Vd = inputs[0].shape(1), V = inputs[1].shape(0), r = inputs[1].shape(1);
  mx::cpu::get_command_encoder(stream()).dispatch(
      [U = inputs[0].data<float>(), w1 = inputs[1].data<float>(), w2 = inputs[2].data<float>(),
       anchor = inputs[3].data<int32_t>(), ids = has_ids_ ? inputs[4].data<int32_t>() : nullptr,
       y = out.data<int32_t>(), k, Vd, V, r]() {
        const Vec& f = vec();
        int32_t prev = anchor[0];
        for (int j = 0; j < k; ++j) {
          // A token id outside w1 (the caller checks the anchor and vocab_ids) adds no bias.
          const float* e = prev >= 0 && prev < V ? w1 + static_cast<int64_t>(prev) * r : nullptr;
          const float* u = U + static_cast<int64_t>(j) * Vd;
          int fast = e ? f.markov_argmax(u, w2, e, Vd, r) : -1;
          if (fast >= 0) {
            prev = ids ? ids[fast] : fast;
            y[j] = prev;
            continue;
          }
          auto z_at = [&](int c) { return e ? u[c] + f.dot(w2 + static_cast<int64_t>(c) * r, e, r) : u[c]; };
          // mx.argmax's order: the larger value, the smaller index on a tie, NaN first.
          int best = 0;
          float bv = z_at(0);
          for (int c = 1; c < Vd && !std::isnan(bv); ++c) {
            const float z = z_at(c);
            if (z > bv || std::isnan(z)) best = c, bv = z;
          }
          prev = ids ? ids[best] : best;
          y[j] = prev;
        }
      });
}

void DraftAttention::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[dspark.draft_attention] runs on the CPU; GPUs use kernels/draft_ops.py's reference");
}
void SiluMul::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[dspark.silu_mul] runs on the CPU; GPUs use kernels/draft_ops.py's reference");
}
void DraftRmsNorm::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[dspark.rms_norm] runs on the CPU; GPUs use mx.fast.rms_norm");
}
void MarkovGreedy::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[dspark.markov_greedy] runs on the CPU; GPUs use kernels/draft_ops.py's reference");
}

}  // namespace dspark
