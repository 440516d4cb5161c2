// Speculative-sampling accept: the op and its CPU evaluation (integer-mass inverse CDF).
#include <cstdint>
#include <sstream>
#include <stdexcept>

#include "dspark.h"
#include "mlx/backend/cpu/encoder.h"

namespace dspark {

namespace {

constexpr int64_t kResidMin = 10995;  // floor(1e-8 * 2^40)
constexpr float kScale = 1099511627776.0f;  // 2^40

inline int64_t mass(float x) {
  x = x > 0.0f ? x : 0.0f;  // NaN -> 0
  x = x < 1.0f ? x : 1.0f;
  return static_cast<int64_t>(x * kScale);
}

struct Row {
  const float* p;   // p_a
  const float* q;   // q_a or nullptr (one-hot of da)
  int da;           // the rejected draft token (one-hot case)
  int mode;         // 0: residual max(p - q, 0); 1: p
  int64_t elem(int64_t i) const {
    if (mode == 1) return mass(p[i]);
    float qi = q ? q[i] : (i == da ? 1.0f : 0.0f);
    return mass(p[i] - qi);
  }
};

void accept_one(const float* p, const float* q, const int32_t* draft, const float* u, float ub,
                int w, int64_t V, int32_t* accepted, int32_t* bonus) {
  const int k = w - 1;
  int a = k;
  for (int j = 0; j < k; ++j) {
    const int d = draft[j];
    float pj = 0.0f, qj = 0.0f;
    if (d >= 0 && d < V) {
      pj = p[j * V + d];
      qj = q ? q[j * V + d] : 1.0f;
    }
    if (!(u[j] * qj < pj)) {
      a = j;
      break;
    }
  }
  Row row{p + a * V, (q && a < k) ? q + a * V : nullptr, a < k ? draft[a] : -1, a < k ? 0 : 1};
  int64_t M = 0;
  for (int64_t i = 0; i < V; ++i) M += row.elem(i);
  if (row.mode == 0 && M <= kResidMin) {
    row.mode = 1;
    M = 0;
    for (int64_t i = 0; i < V; ++i) M += row.elem(i);
  }
  *accepted = a;
  if (M == 0) {
    *bonus = argmax_row(row.p, mx::float32, V);
    return;
  }
  float ubf = ub * 16777216.0f;
  int64_t U = ubf > 0.0f ? (ubf < 16777215.0f ? static_cast<int64_t>(ubf) : 16777215) : 0;
  int64_t T = (M >> 24) * U + (((M & 0xFFFFFF) * U) >> 24);
  int64_t cs = 0;
  for (int64_t i = 0; i < V; ++i) {
    cs += row.elem(i);
    if (cs > T) {
      *bonus = static_cast<int32_t>(i);
      return;
    }
  }
  *bonus = static_cast<int32_t>(V - 1);  // unreachable: T < M
}

}  // namespace

std::vector<mx::array> sampling_accept(const mx::array& p, const std::optional<mx::array>& q,
                                       const mx::array& draft, const mx::array& u,
                                       const mx::array& u_bonus, mx::StreamOrDevice s) {
  if (p.ndim() != 3) throw std::invalid_argument("[dspark.sampling_accept] p must be [B, w, V]");
  const int B = p.shape(0), w = p.shape(1), V = p.shape(2);
  const int k = w - 1;
  if (w < 1 || V < 1) throw std::invalid_argument("[dspark.sampling_accept] p needs w >= 1 and V >= 1");
  auto bad = [&](const char* what, const mx::array& a, mx::Shape want) {
    if (a.shape() != want) {
      std::ostringstream msg;
      msg << "[dspark.sampling_accept] " << what << " has the wrong shape (expected [";
      for (size_t i = 0; i < want.size(); ++i) msg << (i ? ", " : "") << want[i];
      msg << "])";
      throw std::invalid_argument(msg.str());
    }
  };
  if (q) bad("q", *q, {B, k, V});
  bad("draft", draft, {B, k});
  bad("u", u, {B, k});
  bad("u_bonus", u_bonus, {B});
  auto st = mx::to_stream(s);
  auto f32 = [&](const mx::array& a) { return mx::contiguous(mx::astype(a, mx::float32, st), false, st); };
  // Empty inputs (w = 1, or no q) are replaced by one-element placeholders.
  auto qq = (q && k > 0) ? f32(*q) : mx::zeros({1}, mx::float32, st);
  auto dd = k > 0 ? mx::contiguous(mx::astype(draft, mx::int32, st), false, st) : mx::zeros({B, 1}, mx::int32, st);
  auto uu = k > 0 ? f32(u) : mx::zeros({B, 1}, mx::float32, st);
  return mx::array::make_arrays({{B}, {B}}, {mx::int32, mx::int32},
                                std::make_shared<SamplingAccept>(st, q.has_value() && k > 0),
                                {f32(p), qq, dd, uu, f32(u_bonus)});
}

void SamplingAccept::eval_cpu(const std::vector<mx::array>& inputs,
                              std::vector<mx::array>& outputs) {
  for (auto& o : outputs) o.set_data(mx::allocator::malloc(o.nbytes()));
  auto& enc = mx::cpu::get_command_encoder(stream());
  for (auto& a : inputs) enc.set_input_array(a);
  for (auto& o : outputs) enc.set_output_array(o);
  const auto& p = inputs[0];
  const int B = p.shape(0), w = p.shape(1);
  const int64_t V = p.shape(2);
  enc.dispatch([p = p.data<float>(), q = has_q() ? inputs[1].data<float>() : nullptr,
                d = inputs[2].data<int32_t>(), u = inputs[3].data<float>(),
                ub = inputs[4].data<float>(), acc = outputs[0].data<int32_t>(),
                bon = outputs[1].data<int32_t>(), B, w, V]() {
    const int k = w - 1;
    const int ks = k > 0 ? k : 1;  // row stride of the draft / u placeholders
    for (int b = 0; b < B; ++b) {
      accept_one(p + static_cast<int64_t>(b) * w * V, q ? q + static_cast<int64_t>(b) * k * V : nullptr,
                 d + static_cast<int64_t>(b) * ks, u + static_cast<int64_t>(b) * ks, ub[b], w, V,
                 acc + b, bon + b);
    }
  });
}

}  // namespace dspark
