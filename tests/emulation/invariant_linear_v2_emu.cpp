// The faster body kernels/gpu/invariant_linear_v2.h against the first one, invariant_linear.h, on CPU
// fibers (metal_emu.h + warp_fibers.h: the Metal branch of ds_portable.h, one warp at a time, its 32
// lanes as fibers). Random cases: float32 / float16 / bfloat16, dense and affine 2/4/8-bit at groups
// 32/64/128, G = 1..3 weights with and without biases, C = 1, 2, 4 columns per warp, K a multiple of 8
// (of 256 or not), N_g from 1 on, M = 1..33. Checks, bitwise (raw bytes): (1) every v2 output equals
// v1's, and no element past an output is written; (2) v2's scalar-load path (what CUDA takes for an
// unaligned pointer) equals v1; (3) rows of a v2 call from row i equal those rows of the 33-row call;
// and v1 against a double-precision product (rounding of T). Prints "OK" and exits 0, else the failure.
// Argument: the number of random cases (default 60).
#include "metal_emu.h"
#include "warp_fibers.h"
#include "invariant_linear.h"
#include "invariant_linear_v2.h"
#undef thread
#undef device
#undef threadgroup

#include <cstdint>
#include <cstdlib>
#include <string>

constexpr int kMaxM = 33, kGuard = 24, kNT = 128;
static const char* g_case = "";

template <class T>
struct Problem {
  int bits, group, G, K, N[3];
  std::vector<T> x, w[3], s[3], z[3], b[3];  // x [kMaxM, K]; dense w or affine scales s / biases z; bias b
  std::vector<uint32_t> q[3];
  double at(int g, int n, int k) const {
    if (!bits) return (double)(float)w[g][(size_t)n * K + k];
    const long bit = (long)k * bits;
    const uint32_t v = (q[g][(size_t)n * (K * bits / 32) + bit / 32] >> (bit % 32)) & ((1u << bits) - 1u);
    const size_t i = (size_t)n * (K / group) + k / group;
    return (double)std::fma((float)s[g][i], (float)v, (float)z[g][i]);
  }
};

template <class T>
static Problem<T> make(int bits, int group, int G, int K, const int* N, std::mt19937& rng) {
  Problem<T> p{bits, group, G, K, {N[0], N[1], N[2]}, {}, {}, {}, {}, {}, {}};
  std::normal_distribution<float> nd;
  auto fill = [&](std::vector<T>& v, size_t n, float scale, float off) {
    v.resize(n);
    for (auto& e : v) e = (T)(off + scale * nd(rng));
  };
  fill(p.x, (size_t)kMaxM * K, 1.0f, 0.0f);
  for (int g = 0; g < G; ++g) {
    fill(p.b[g], N[g], 1.0f, 0.0f);
    if (!bits) {
      fill(p.w[g], (size_t)N[g] * K, 0.1f, 0.0f);
      continue;
    }
    p.s[g].resize((size_t)N[g] * K / group);
    for (auto& e : p.s[g]) e = (T)(0.01f + 0.05f * std::fabs(nd(rng)));
    fill(p.z[g], (size_t)N[g] * K / group, 0.2f, 0.0f);
    p.q[g].assign((size_t)N[g] * K * bits / 32, 0u);
    std::uniform_int_distribution<uint32_t> qd(0, (1u << bits) - 1u);
    for (int n = 0; n < N[g]; ++n)
      for (int k = 0; k < K; ++k) {
        const long bit = (long)k * bits;
        p.q[g][(size_t)n * (K * bits / 32) + bit / 32] |= qd(rng) << (bit % 32);
      }
  }
  return p;
}

template <class T>
using Outs = std::vector<std::vector<T>>;

template <class T>
static Outs<T> fresh(const Problem<T>& p, int M) {
  Outs<T> o(3);
  for (int g = 0; g < p.G; ++g) {
    o[g].resize((size_t)M * p.N[g] + kGuard);
    std::memset(o[g].data(), 0xA5, sizeof(T) * o[g].size());
  }
  return o;
}

// One launch over rows [i, i + M) of x: V = 0 the v1 body, V = 1 v2 at C columns per warp, V = 2 v2's
// scalar-load path (dense) at C.
template <class T, int BITS, int G, int HB, int C, int V>
static Outs<T> launch(const Problem<T>& p, int i, int M) {
  Outs<T> o = fresh(p, M);
  const T* x = p.x.data() + (size_t)i * p.K;
  auto pick = [&](int g) { return g < G ? g : 0; };
  const T *w[3], *s[3], *z[3], *b[3];
  const uint32_t* q[3];
  T* out[3];
  for (int g = 0; g < 3; ++g) {
    const int h = pick(g);
    w[g] = p.w[h].data(), s[g] = p.s[h].data(), z[g] = p.z[h].data(), b[g] = p.b[h].data(), q[g] = p.q[h].data();
    out[g] = o[h].data();
  }
  const int N0 = p.N[0], N1 = G > 1 ? p.N[1] : 0, N2 = G > 2 ? p.N[2] : 0;
  const int warps = V == 0 ? N0 + N1 + N2 : (N0 + C - 1) / C + (N1 + C - 1) / C + (N2 + C - 1) / C;
  const int blocks = (warps + kNT / 32 - 1) / (kNT / 32);
  for (int bx = 0; bx < blocks; ++bx)
    for (int warp = 0; warp < kNT / 32; ++warp) {
      warp_fibers::run_warp([&](int lane) {
        ds_ctx c;
        c.tid = warp * 32 + lane, c.nthreads = kNT, c.bx = bx, c.by = 0;
        if (V == 0 && BITS == 0) {
          ds_il_dense<T, G, HB>(c, x, w[0], w[1], w[2], b[0], b[1], b[2], out[0], out[1], out[2], M, N0, N1, N2, p.K);
        } else if (V == 0) {
          ds_il_affine<T, BITS == 0 ? 4 : BITS, G, HB>(c, x, q[0], s[0], z[0], q[1], s[1], z[1], q[2], s[2], z[2],
                                                       b[0], b[1], b[2], out[0], out[1], out[2], M, N0, N1, N2, p.K,
                                                       p.group);
        } else if (V == 1 && BITS == 0) {
          ds_il2_dense<T, C == 0 ? 1 : C, G, HB>(c, x, w[0], w[1], w[2], b[0], b[1], b[2], out[0], out[1], out[2], M,
                                                 N0, N1, N2, p.K);
        } else if (V == 1) {
          ds_il2_affine<T, BITS == 0 ? 4 : BITS, C == 0 ? 1 : C, G, HB>(c, x, q[0], s[0], z[0], q[1], s[1], z[1], q[2],
                                                                        s[2], z[2], b[0], b[1], b[2], out[0], out[1],
                                                                        out[2], M, N0, N1, N2, p.K, p.group);
        } else {  // the body's dispatch, then the scalar-load column code
          constexpr int CC = C == 0 ? 1 : C;
          int n0;
          const int g = ds_il2_warp_cols<CC, G>(c, N0, N1, N2, n0);
          if (g < 0) return;
          const int N = g == 0 ? N0 : (g == 1 ? N1 : N2);
          const bool hb = ((HB >> g) & 1) != 0;
          if (BITS == 0)
            ds_il2_dense_cols<T, CC, false>(x, w[g], hb, b[g], out[g], M, n0, N, p.K, lane);
          else
            ds_il2_affine_cols<T, BITS == 0 ? 4 : BITS, CC, false>(x, q[g], s[g], z[g], hb, b[g], out[g], M, n0, N,
                                                                   p.K, p.group, lane);
        }
      });
    }
  return o;
}

static int fails = 0;

template <class T>
static bool same(const Problem<T>& p, const Outs<T>& a, const Outs<T>& b, int M, const std::string& what) {
  for (int g = 0; g < p.G; ++g)
    if (std::memcmp(a[g].data(), b[g].data(), sizeof(T) * a[g].size()) != 0) {
      size_t e = 0;
      while (std::memcmp(&a[g][e], &b[g][e], sizeof(T)) == 0) ++e;
      std::printf("%s: %s, weight %d, M = %d: element %zu (row %zu, column %zu%s) differs: %.9g vs %.9g\n", g_case,
                  what.c_str(), g, M, e, e / p.N[g], e % p.N[g], e >= (size_t)M * p.N[g] ? ", past the output" : "",
                  (double)(float)a[g][e], (double)(float)b[g][e]);
      ++fails;
      return false;
    }
  return true;
}

template <class T, int BITS, int G, int HB, int C>
static void check_c(const Problem<T>& p, const std::vector<int>& Ms, std::mt19937& rng, bool scalar) {
  const std::string c = "C " + std::to_string(C);
  Outs<T> full1 = launch<T, BITS, G, HB, C, 0>(p, 0, kMaxM), full2 = launch<T, BITS, G, HB, C, 1>(p, 0, kMaxM);
  if (!same(p, full1, full2, kMaxM, "v2 " + c + " vs v1")) return;
  for (int M : Ms) {
    Outs<T> a = launch<T, BITS, G, HB, C, 0>(p, 0, M), b = launch<T, BITS, G, HB, C, 1>(p, 0, M);
    if (!same(p, a, b, M, "v2 " + c + " vs v1")) return;
  }
  if (scalar) {
    const int M = Ms[rng() % Ms.size()];
    if (!same(p, launch<T, BITS, G, HB, C, 0>(p, 0, M), launch<T, BITS, G, HB, C, 2>(p, 0, M), M,
              "v2 scalar loads " + c + " vs v1"))
      return;
  }
  const int M = 1 + (int)(rng() % 12), i = (int)(rng() % (kMaxM - M + 1));  // rows i.. alone: those of the full call
  Outs<T> part = launch<T, BITS, G, HB, C, 1>(p, i, M);
  for (int g = 0; g < p.G; ++g)
    if (std::memcmp(part[g].data(), &full2[g][(size_t)i * p.N[g]], sizeof(T) * M * p.N[g]) != 0) {
      std::printf("%s: v2 %s, weight %d: rows %d..%d of a %d-row call differ from the %d-row call\n", g_case,
                  c.c_str(), g, i, i + M - 1, M, kMaxM);
      ++fails;
      return;
    }
}

template <class T, int BITS, int G, int HB>
static void check(const Problem<T>& p, int C, const std::vector<int>& Ms, std::mt19937& rng, bool scalar) {
  if (C == 1) check_c<T, BITS, G, HB, 1>(p, Ms, rng, scalar);
  if (C == 2) check_c<T, BITS, G, HB, 2>(p, Ms, rng, scalar);
  if (C == 4) check_c<T, BITS, G, HB, 4>(p, Ms, rng, scalar);
}

// v1 against a double-precision product (v1 itself is tested further in invariant_linear_emu.cpp).
template <class T, int BITS, int G, int HB>
static void check_v1_values(const Problem<T>& p) {
  const Outs<T> o = launch<T, BITS, G, HB, 1, 0>(p, 0, kMaxM);
  const double tol = sizeof(T) == 4 ? 1e-5 : 1e-2;
  for (int g = 0; g < G; ++g)
    for (int m = 0; m < kMaxM; ++m)
      for (int n = 0; n < p.N[g]; ++n) {
        double ref = (HB >> g & 1) ? (double)(float)p.b[g][n] : 0.0, mag = std::fabs(ref);
        for (int k = 0; k < p.K; ++k) {
          const double t = (double)(float)p.x[(size_t)m * p.K + k] * p.at(g, n, k);
          ref += t, mag += std::fabs(t);
        }
        const double got = (float)o[g][(size_t)m * p.N[g] + n];
        if (!(std::fabs(got - ref) <= tol * (mag + std::fabs(ref)) + 1e-6)) {
          std::printf("%s: v1 out[%d][%d, %d] = %.8g, expected %.8g\n", g_case, g, m, n, got, ref);
          ++fails;
          return;
        }
      }
}

template <class T, int BITS>
static void run_case(int G, int hb, int C, int group, int K, const int* N, const std::vector<int>& Ms,
                     std::mt19937& rng, bool values, bool scalar) {
  const Problem<T> p = make<T>(BITS, group, G, K, N, rng);
#define IL2_CASE(GG, HH)                                                 \
  if (G == GG && hb == HH) {                                             \
    if (values) check_v1_values<T, BITS, GG, HH>(p);                     \
    return check<T, BITS, GG, HH>(p, C, Ms, rng, scalar);                \
  }
  IL2_CASE(1, 0) IL2_CASE(1, 1) IL2_CASE(2, 2) IL2_CASE(3, 5) IL2_CASE(3, 7)
#undef IL2_CASE
  std::printf("no instance for G %d HB %d\n", G, hb);
  ++fails;
}

template <class T>
static void run_kind(int bits, int G, int hb, int C, int group, int K, const int* N, const std::vector<int>& Ms,
                     std::mt19937& rng, bool values, bool scalar) {
  if (bits == 0) run_case<T, 0>(G, hb, C, group, K, N, Ms, rng, values, scalar);
  if (bits == 2) run_case<T, 2>(G, hb, C, group, K, N, Ms, rng, values, scalar);
  if (bits == 4) run_case<T, 4>(G, hb, C, group, K, N, Ms, rng, values, scalar);
  if (bits == 8) run_case<T, 8>(G, hb, C, group, K, N, Ms, rng, values, scalar);
}

int main(int argc, char** argv) {
  const int cases = argc > 1 ? std::atoi(argv[1]) : 60;
  std::mt19937 rng(argc > 2 ? (unsigned)std::atoi(argv[2]) : 17u);
  const int HBS[3][2] = {{0, 1}, {2, 2}, {5, 7}};
  for (int t = 0; t < cases && !fails; ++t) {
    // every dtype, kind and C in turn; the rest drawn
    const int dt = t % 3, bits = (int[]){0, 2, 4, 8}[(t / 3) % 4], C = (int[]){1, 2, 4}[(t / 12) % 3];
    const int G = 1 + (int)(rng() % 3), hb = HBS[G - 1][rng() % 2], group = (int[]){32, 64, 128}[rng() % 3];
    const int unit = bits ? group : 8, K = unit * (1 + (int)(rng() % (bits ? 700 / unit : 90)));
    int N[3];
    for (int g = 0; g < 3; ++g) N[g] = 1 + (int)(rng() % (t % 5 == 0 ? 3 : 11));
    std::vector<int> Ms;
    if (t < 3) {  // M = 1..33, every one
      for (int m = 1; m <= kMaxM; ++m) Ms.push_back(m);
    } else {
      Ms = {1, 2, 3, 4, 5, 8, 9};
      for (int j = 0; j < 3; ++j) Ms.push_back(10 + (int)(rng() % 24));
    }
    static char label[160];
    std::snprintf(label, sizeof label, "case %d (%s, bits %d, group %d, G %d, HB %d, K %d, N %d/%d/%d)", t,
                  (const char*[]){"float32", "float16", "bfloat16"}[dt], bits, group, G, hb, K, N[0], N[1], N[2]);
    g_case = label;
    const bool values = t % 4 == 0, scalar = t % 2 == 1;
    if (dt == 0) run_kind<float>(bits, G, hb, C, group, K, N, Ms, rng, values, scalar);
    if (dt == 1) run_kind<half>(bits, G, hb, C, group, K, N, Ms, rng, values, scalar);
    if (dt == 2) run_kind<bfloat16_t>(bits, G, hb, C, group, K, N, Ms, rng, values, scalar);
  }
  if (fails) return 1;
  std::printf("OK %d cases\n", cases);
  return 0;
}
