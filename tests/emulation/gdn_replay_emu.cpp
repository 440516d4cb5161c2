// Runs the GPU body kernels/gpu/gdn_replay.h on the CPU: the Metal branch of ds_portable.h with
// one std::thread per lane of a 32-lane SIMD-group, SIMD shuffles through a shared slot array
// (every shuffle in the body is called by all 32 lanes). Checks
//   (1) the state and y against a double-precision delta rule,
//   (2) bitwise position invariance: one T-position call equals T one-position calls,
//   (3) the state-only instance (WITH_Y false) leaves the same state bits as the one with y.
// Prints "OK ..." and exits 0, else names the failure.
#include "metal_emu.h"
#include "gdn_replay.h"
#undef thread
#undef device
#undef threadgroup

struct Shape { int B, T, Hk, Hv, Dk, Dv; };
struct In { std::vector<float> q, k, v, g, beta, s0; };

// The body over every state row, lanes as threads: (state, y).
template <bool WITH_Y>
static void run(const Shape& s, const float* q, const float* k, const float* v, const float* g, const float* beta,
                const float* s0, float* out, float* y) {
  std::barrier<> bar(32);
  g_bar = &bar;
  std::vector<std::thread> th;
  const int rows = s.B * s.Hv * s.Dv;
  for (uint lane = 0; lane < 32; ++lane)
    th.emplace_back([&, lane] {
      t_tid = lane;
      for (int row = 0; row < rows; ++row)
        ds_gr_row<WITH_Y>(q, k, v, g, beta, s0, out, y, s.T, s.Hk, s.Hv, s.Dk, s.Dv, row, lane);
    });
  for (auto& t : th) t.join();
}

// Positions [t0, t0 + n) of x, whose positions hold `per` floats each (batch-major).
static std::vector<float> slice(const std::vector<float>& x, const Shape& s, int per, int t0, int n) {
  std::vector<float> o;
  for (int b = 0; b < s.B; ++b)
    o.insert(o.end(), x.begin() + ((long)b * s.T + t0) * per, x.begin() + ((long)b * s.T + t0 + n) * per);
  return o;
}

int main() {
  const Shape s{2, 7, 2, 4, 64, 8};  // GQA (2 value heads per key head), 2 floats per lane
  std::mt19937 gen(3);
  std::normal_distribution<float> nd;
  std::uniform_real_distribution<float> ud(0.5f, 1.0f);
  In x;
  auto fill = [&](std::vector<float>& a, size_t n, float sc) { a.resize(n); for (auto& e : a) e = nd(gen) * sc; };
  fill(x.q, (size_t)s.B * s.T * s.Hk * s.Dk, 0.125f);
  fill(x.k, x.q.size(), 0.125f);
  fill(x.v, (size_t)s.B * s.T * s.Hv * s.Dv, 1.0f);
  x.g.resize((size_t)s.B * s.T * s.Hv);
  for (auto& e : x.g) e = ud(gen);
  x.beta.resize(x.g.size());
  for (auto& e : x.beta) e = ud(gen) - 0.4f;
  fill(x.s0, (size_t)s.B * s.Hv * s.Dv * s.Dk, 0.1f);
  const size_t ny = (size_t)s.B * s.T * s.Hv * s.Dv;
  std::vector<float> out(x.s0.size()), y(ny), out2(x.s0.size()), ydummy(1);
  run<true>(s, x.q.data(), x.k.data(), x.v.data(), x.g.data(), x.beta.data(), x.s0.data(), out.data(), y.data());
  // (1) double precision
  std::vector<double> st(x.s0.begin(), x.s0.end());
  double es = 0, ey = 0;
  for (int b = 0; b < s.B; ++b)
    for (int t = 0; t < s.T; ++t)
      for (int hv = 0; hv < s.Hv; ++hv) {
        const int hk = hv / (s.Hv / s.Hk);
        const long gt = ((long)b * s.T + t) * s.Hv + hv, kt = (((long)b * s.T + t) * s.Hk + hk) * s.Dk;
        for (int dv = 0; dv < s.Dv; ++dv) {
          double* r = &st[(((long)b * s.Hv + hv) * s.Dv + dv) * s.Dk];
          double kv = 0, yy = 0;
          for (int i = 0; i < s.Dk; ++i) { r[i] *= x.g[gt]; kv += r[i] * x.k[kt + i]; }
          const double d = (x.v[gt * s.Dv + dv] - kv) * x.beta[gt];
          for (int i = 0; i < s.Dk; ++i) { r[i] += x.k[kt + i] * d; yy += r[i] * x.q[kt + i]; }
          ey = std::max(ey, std::fabs(yy - y[gt * s.Dv + dv]));
        }
      }
  for (size_t i = 0; i < st.size(); ++i) es = std::max(es, std::fabs(st[i] - out[i]));
  if (es > 1e-5 || ey > 1e-5) { printf("FAIL reference: state error %g, y error %g\n", es, ey); return 1; }
  // (3) the state-only instance
  run<false>(s, x.q.data(), x.k.data(), x.v.data(), x.g.data(), x.beta.data(), x.s0.data(), out2.data(), ydummy.data());
  if (std::memcmp(out.data(), out2.data(), out.size() * sizeof(float)) != 0) {
    printf("FAIL the state-only instance leaves different state bits\n");
    return 1;
  }
  // (2) one position at a time
  Shape one = s;
  one.T = 1;
  std::vector<float> cur = x.s0, nxt(cur.size()), y1((size_t)s.B * s.Hv * s.Dv);
  for (int t = 0; t < s.T; ++t) {
    auto q = slice(x.q, s, s.Hk * s.Dk, t, 1), k = slice(x.k, s, s.Hk * s.Dk, t, 1);
    auto v = slice(x.v, s, s.Hv * s.Dv, t, 1), g = slice(x.g, s, s.Hv, t, 1), be = slice(x.beta, s, s.Hv, t, 1);
    run<true>(one, q.data(), k.data(), v.data(), g.data(), be.data(), cur.data(), nxt.data(), y1.data());
    auto yt = slice(y, s, s.Hv * s.Dv, t, 1);
    if (std::memcmp(yt.data(), y1.data(), y1.size() * sizeof(float)) != 0) {
      printf("FAIL invariance: y at position %d of a %d-position call differs from a 1-position call\n", t, s.T);
      return 1;
    }
    cur.swap(nxt);
  }
  if (std::memcmp(cur.data(), out.data(), out.size() * sizeof(float)) != 0) {
    printf("FAIL invariance: %d one-position calls leave a different state than one %d-position call\n", s.T, s.T);
    return 1;
  }
  printf("OK state error %g, y error %g\n", es, ey);
  return 0;
}
