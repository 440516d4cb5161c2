// A target's RoPE on the CPU as one primitive (float32). Semantics:
// python/mlx_dspark/kernels/target_ops.py::rope_reference.
//
// Why: MLX's CPU build runs mx.fast.rope as its fallback, ~29 ops built and run per call, and a
// decode forward of the demo target has 60 of them (its queries and keys in 30 layers): with the
// norms' fallbacks, ~10-15 ms of a ~60 ms step (bench/results/cpu-ops.md).
//
// Each row's output depends only on that row and its position (offset[b] + l), never on how many
// rows the call has: a verify block's rows equal the plain steps' bitwise. The angles are taken in
// double precision, once per (batch row, position) a call has, then rounded to float32.
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <vector>

#include "dspark.h"
#include "cpu_vec.h"

namespace dspark {

using namespace cpu;

mx::array target_rope(const mx::array& x, const mx::array& offset, int dims, bool traditional, float base,
                      float scale, mx::StreamOrDevice s) {
  constexpr const char* op = "rope";
  auto st = cpu_stream(op, s);
  need_f32(op, x, "x");
  if (x.ndim() < 2) fail(op, "x must be [..., L, D]");
  if (dims < 2 || dims % 2 != 0 || dims > x.shape(-1)) fail(op, "dims must be even and at most x's last axis");
  if (!(base > 0.0f)) fail(op, "base must be positive");
  const bool per_row = offset.ndim() == 1 && offset.size() > 1;
  if (offset.ndim() > 1 || (offset.ndim() == 1 && !per_row && offset.size() != 1) ||
      (per_row && (x.ndim() < 3 || offset.size() != static_cast<size_t>(x.shape(0)))))
    fail(op, "offset must be a scalar or one position per batch row of x ([x.shape(0)])");
  if (!mx::issubdtype(offset.dtype(), mx::integer)) fail(op, "offset must be an integer array");
  // x as it comes (a transposed view, from mlx-lm: eval reads it through cpu::RowOrder), the offset
  // as it is where already int32: no graph node beyond the op's own.
  std::vector<mx::array> inputs = {x, cpu::as_contiguous(offset.dtype() == mx::int32 ? offset
                                                                                    : mx::astype(offset, mx::int32, st),
                                                         st)};
  return mx::array(x.shape(), mx::float32, std::make_shared<TargetRope>(st, dims, traditional, base, scale), inputs);
}

void TargetRope::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& out = outputs[0];
  begin(stream(), inputs, out);
  const auto& x = inputs[0];
  const int D = x.shape(-1), L = x.shape(-2);
  const int64_t rows = static_cast<int64_t>(x.size() / D);
  const int nb = static_cast<int>(inputs[1].size());
  mx::cpu::get_command_encoder(stream()).dispatch(
      [xr = RowOrder(x), offp = inputs[1].data<int32_t>(), y = out.data<float>(), D, L, rows, nb, dims = dims_,
       trad = traditional_, base = base_, scale = scale_]() {
        std::vector<char> xbuf;
        const float* xp = static_cast<const float*>(xr.get(xbuf));
        const int half = dims / 2;
        const int64_t per_batch = rows / nb;  // rows of one batch row's offset (all of them for a scalar)
        // cos / sin per (offset, position, pair), once per call.
        std::vector<double> inv(half);
        for (int i = 0; i < half; ++i) inv[i] = std::pow(static_cast<double>(base), -static_cast<double>(i) / half);
        std::vector<float> cs(static_cast<size_t>(nb) * L * half), sn(cs.size());
        for (int b = 0; b < nb; ++b)
          for (int l = 0; l < L; ++l) {
            const double pos = (static_cast<double>(offp[b]) + l) * static_cast<double>(scale);
            float* c = cs.data() + (static_cast<size_t>(b) * L + l) * half;
            float* sv = sn.data() + (static_cast<size_t>(b) * L + l) * half;
            for (int i = 0; i < half; ++i) {
              const double a = pos * inv[i];
              c[i] = static_cast<float>(std::cos(a)), sv[i] = static_cast<float>(std::sin(a));
            }
          }
        for (int64_t r = 0; r < rows; ++r) {
          const int b = static_cast<int>(r / per_batch), l = static_cast<int>(r % L);
          const float* c = cs.data() + (static_cast<size_t>(b) * L + l) * half;
          const float* sv = sn.data() + (static_cast<size_t>(b) * L + l) * half;
          const float* xr = xp + r * D;
          float* o = y + r * D;
          for (int i = 0; i < half; ++i) {
            const int i1 = trad ? 2 * i : i, i2 = trad ? 2 * i + 1 : i + half;
            const float a = xr[i1], bb = xr[i2];
            o[i1] = a * c[i] - bb * sv[i];
            o[i2] = a * sv[i] + bb * c[i];
          }
          for (int i = dims; i < D; ++i) o[i] = xr[i];
        }
      });
}

void TargetRope::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[dspark.rope] runs on the CPU; GPUs use mx.fast.rope");
}

}  // namespace dspark
