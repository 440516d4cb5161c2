// Runs the GPU body kernels/gpu/invariant_attention.h on the CPU: the Metal branch of ds_portable.h
// with one std::thread per GPU thread, threadgroup barriers as a std::barrier and SIMD shuffles
// through a shared slot array (every shuffle in the body is called by all threads of the group).
// Checks (1) the output against a double-precision softmax attention, (2) bitwise width invariance:
// row i of a 16-query call equals a 1-query call at the same position with the keys up to it.
// Prints "OK" and exits 0, else names the failure.
#include "metal_emu.h"
#include "invariant_attention.h"
#undef thread
#undef device
#undef threadgroup

struct Shape { int B, H, Lq, Hkv, Lk, D; };

// q [B,H,Lq,D] with query-row stride qrow; k, v [B,Hkv,*,D] with key-row capacity cap (a cache view).
static std::vector<float> run(const Shape& s, const float* q, long qrow, const float* k, const float* v, long cap, float scale) {
  const int NT = DS_IA_THREADS;
  std::vector<float> out((size_t)s.B * s.H * s.Lq * s.D);
  for (int bh = 0; bh < s.B * s.H; ++bh)
    for (int qi = 0; qi < s.Lq; ++qi) {
      float sq[DS_IA_MAX_D], sp[DS_IA_THREADS], red[DS_IA_THREADS / 32];
      std::barrier<> bar(NT);
      g_bar = &bar;
      std::vector<std::thread> th;
      for (int t = 0; t < NT; ++t)
        th.emplace_back([&, t] {
          t_tid = t;
          ds_ctx c;
          c.tid = t; c.nthreads = NT; c.bx = qi; c.by = bh;
          const int b = bh / s.H, h = bh % s.H, kvh = h / (s.H / s.Hkv);
          const long qs0 = (long)s.H * qrow * s.D, qs1 = qrow * s.D, ks0 = (long)s.Hkv * cap * s.D, ks1 = cap * s.D;
          ds_ia_row<float>(c, q, b * qs0 + h * qs1 + (long)qi * s.D, 1, k, b * ks0 + kvh * ks1, s.D, 1, v,
                           b * ks0 + kvh * ks1, s.D, 1, s.D, s.Lk - s.Lq + qi + 1, scale, out.data(),
                           ((long)(b * s.H + h) * s.Lq + qi) * s.D, sq, sp, red);
        });
      for (auto& t : th) t.join();
    }
  return out;
}

int main() {
  const Shape s{2, 4, 16, 2, 150, 160};  // 2 chunks of keys; D > 128: two output dims per thread
  const float scale = 0.11f;
  std::mt19937 g(7);
  std::normal_distribution<float> nd;
  std::vector<float> q((size_t)s.B * s.H * s.Lq * s.D), k((size_t)s.B * s.Hkv * s.Lk * s.D), v(k.size());
  for (auto& x : q) x = nd(g);
  for (auto& x : k) x = nd(g);
  for (auto& x : v) x = nd(g);
  std::vector<float> out = run(s, q.data(), s.Lq, k.data(), v.data(), s.Lk, scale);
  double err = 0;
  for (int bh = 0; bh < s.B * s.H; ++bh)
    for (int qi = 0; qi < s.Lq; ++qi) {
      const int b = bh / s.H, kv = b * s.Hkv + (bh % s.H) / (s.H / s.Hkv), n = s.Lk - s.Lq + qi + 1;
      std::vector<double> w(n);
      double mx = -1e300, l = 0;
      for (int j = 0; j < n; ++j) {
        double d = 0;
        for (int e = 0; e < s.D; ++e) d += (double)q[((size_t)bh * s.Lq + qi) * s.D + e] * k[((size_t)kv * s.Lk + j) * s.D + e];
        w[j] = d * scale;
        mx = std::max(mx, w[j]);
      }
      for (int j = 0; j < n; ++j) { w[j] = std::exp(w[j] - mx); l += w[j]; }
      for (int e = 0; e < s.D; ++e) {
        double a = 0;
        for (int j = 0; j < n; ++j) a += w[j] * v[((size_t)kv * s.Lk + j) * s.D + e];
        err = std::max(err, std::fabs(a / l - out[((size_t)bh * s.Lq + qi) * s.D + e]));
      }
    }
  if (err > 1e-4) { printf("FAIL reference: max error %g\n", err); return 1; }
  for (int qi = 0; qi < s.Lq; ++qi) {  // the same row as a 1-query call over the keys up to it
    Shape one = s;
    one.Lq = 1;
    one.Lk = s.Lk - s.Lq + qi + 1;
    std::vector<float> o = run(one, q.data() + (size_t)qi * s.D, s.Lq, k.data(), v.data(), s.Lk, scale);
    for (int bh = 0; bh < s.B * s.H; ++bh)
      if (std::memcmp(&o[(size_t)bh * s.D], &out[((size_t)bh * s.Lq + qi) * s.D], s.D * sizeof(float)) != 0) {
        printf("FAIL invariance: row %d of a %d-query call differs from the 1-query call\n", qi, s.Lq);
        return 1;
      }
  }
  printf("OK max error %g\n", err);
  return 0;
}
