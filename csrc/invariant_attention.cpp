// Width-invariant causal attention on the CPU: the decode path's attention (plain steps and verify
// rows alike). Semantics: python/mlx_dspark/kernels/invariant.py::invariant_attention_reference.
//
// Query row i of q [B, H, Lq, D] sits at position Lk - Lq + i and reads exactly its n = Lk - Lq +
// i + 1 causal keys of k / v [B, Hkv, Lk, D] (query head h reads kv head h / (H / Hkv)):
//   s_j = scale * dot(q, k_j)          one fixed-order dot (8 lanes, then a fixed tree, then the tail)
//   p_j = exp(s_j - max s)             elementwise; l = sum p_j in lanes of 8, then the tail
//   out = (sum_j p_j v_j) / l          accumulated key by key in key order
// Every step depends only on the row's own q, keys and values and on n, never on Lq or on keys
// past the row, so a verify row is bit-identical to the plain step at its position. The previous
// CPU path called MLX's attention once per row (bit-identical too): about eight ops per extra row
// per layer, which made a width-2 verify cost 1.33 plain steps on the demo model.
#include <sstream>

#include "cpu_pool.h"
#include "cpu_vec.h"

namespace dspark {

using namespace cpu;

mx::array invariant_attention_cpu(const mx::array& q, const mx::array& k, const mx::array& v, float scale,
                                  mx::StreamOrDevice s) {
  constexpr const char* op = "invariant_attention";
  auto st = cpu_stream(op, s);
  for (auto* a : {&q, &k, &v}) need_f32(op, *a, "q, k and v");
  if (q.ndim() != 4 || k.ndim() != 4 || v.shape() != k.shape())
    fail(op, "q must be [B, H, Lq, D] and k, v [B, Hkv, Lk, D], one shape");
  if (k.shape(0) != q.shape(0) || k.shape(3) != q.shape(3)) fail(op, "q, k and v must share B and D");
  if (k.shape(1) < 1 || q.shape(1) % k.shape(1) != 0) fail(op, "q's heads must be a multiple of k's");
  if (k.shape(2) < q.shape(2)) {
    std::ostringstream m;
    m << "the cache holds " << k.shape(2) << " keys for " << q.shape(2) << " query rows";
    fail(op, m.str());
  }
  return mx::array(q.shape(), mx::float32, std::make_shared<InvariantAttention>(st, scale), {q, k, v});
}

void InvariantAttention::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& out = outputs[0];
  begin(stream(), inputs, out);
  const auto& q = inputs[0];
  const auto& k = inputs[1];
  const auto& v = inputs[2];
  const int B = q.shape(0), H = q.shape(1), Lq = q.shape(2), D = q.shape(3), Hkv = k.shape(1), Lk = k.shape(2);
  auto strides = [](const mx::array& a) {
    return std::vector<int64_t>(a.strides().begin(), a.strides().end());
  };
  mx::cpu::get_command_encoder(stream()).dispatch([qp = q.data<float>(), kp = k.data<float>(), vp = v.data<float>(),
                                                   op = out.data<float>(), qs = strides(q), ks = strides(k),
                                                   vs = strides(v), B, H, Lq, D, Hkv, Lk, scale = scale_]() {
    const Vec& f = vec();
    const int rep = H / Hkv;
    // One task per (batch row, query head); threads only where the work pays for waking them.
    auto head = [&](int task) {
      const int b = task / H, h = task % H, g = h / rep;
      std::vector<float> qrow(D), krow(D), sc(std::max(Lk, 1));
      const float* kb = kp + b * ks[0] + g * ks[1];
      const float* vb = vp + b * vs[0] + g * vs[1];
      for (int i = 0; i < Lq; ++i) {
        const float* qi = qp + b * qs[0] + h * qs[1] + i * qs[2];
        for (int d = 0; d < D; ++d) qrow[d] = qi[d * qs[3]];
        const int n = Lk - Lq + i + 1;
        float m = -INFINITY;
        for (int j = 0; j < n; ++j) {
          const float* kj = kb + j * ks[2];
          if (ks[3] != 1) {
            for (int d = 0; d < D; ++d) krow[d] = kj[d * ks[3]];
            kj = krow.data();
          }
          sc[j] = scale * f.dot(qrow.data(), kj, D);
          m = std::max(m, sc[j]);
        }
        const float l = f.exp_shift_sum(sc.data(), m, n);
        float* y = op + ((static_cast<int64_t>(b) * H + h) * Lq + i) * D;
        std::fill(y, y + D, 0.0f);
        for (int j = 0; j < n; ++j) {
          const float* vj = vb + j * vs[2];
          if (vs[3] != 1) {
            for (int d = 0; d < D; ++d) krow[d] = vj[d * vs[3]];
            vj = krow.data();
          }
          f.axpy(sc[j], vj, y, D);
        }
        const float inv = 1.0f / l;
        for (int d = 0; d < D; ++d) y[d] *= inv;
      }
    };
    const int tasks = B * H;
    if (static_cast<int64_t>(tasks) * Lq * Lk * D >= kParallelWork) {
      parallel_for(tasks, head);
    } else {
      for (int t = 0; t < tasks; ++t) head(t);
    }
  });
}

void InvariantAttention::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[dspark.invariant_attention] runs on the CPU; GPUs use kernels/invariant.py's GPU instance");
}

}  // namespace dspark
