// Runs the GPU body kernels/gpu/invariant_gather.h (MoE experts) on the CPU: the Metal branch of
// ds_portable.h, one warp at a time, its lanes as fibers (metal_emu.h, warp_fibers.h). Experts are packed as mlx-lm stores
// them ([E, N, K] dense, or MLX's affine layout per expert). Checks, for dense experts and for bits
// 2, 4, 8 at groups 32, 64, 128, in both of mlx-lm's layouts (gate / up: one x row per token for its k
// experts, rep = k; down and the sorted calls: one x row per pair, rep = 1):
// (1) the output against a double-precision product;
// (2) every output row equals, bitwise, the dense body (invariant_linear.h) run on that row alone
//     (M = 1) with that expert's weight;
// (3) width invariance: the pairs of the first t tokens, t = 1..T (T up to 17), give the rows of the T-token call
//     bitwise, and the same pairs sorted by expert (mlx-lm sorts from 64 pairs on) give them too;
// (4) two weights in one launch (gate and up) give what each gives alone, bitwise.
// Prints "OK" and exits 0, else the failure.
#include "metal_emu.h"
#include "invariant_linear.h"
#include "invariant_gather.h"
#undef thread
#undef device
#undef threadgroup
#include "warp_fibers.h"

#include <algorithm>
#include <numeric>

struct Experts {
  int E, N, K, bits, group;  // bits 0: dense
  std::vector<float> dense, scales, biases;
  std::vector<uint32_t> packed;
  float at(int e, int n, int k) const {
    const size_t row = (size_t)e * N + n;
    if (!bits) return dense[row * K + k];
    const long bit = (long)k * bits;
    const uint32_t q = (packed[row * (K * bits / 32) + bit / 32] >> (bit % 32)) & ((1u << bits) - 1u);
    const size_t g = row * (K / group) + k / group;
    return scales[g] * (float)q + biases[g];
  }
};

static Experts make(int E, int N, int K, int bits, int group, std::mt19937& g) {
  Experts w{E, N, K, bits, group, {}, {}, {}, {}};
  std::normal_distribution<float> nd;
  const size_t rows = (size_t)E * N;
  if (!bits) {
    w.dense.resize(rows * K);
    for (auto& v : w.dense) v = nd(g);
    return w;
  }
  w.packed.assign(rows * K * bits / 32, 0u);
  w.scales.resize(rows * K / group);
  w.biases.resize(rows * K / group);
  for (auto& v : w.scales) v = 0.01f + 0.1f * std::fabs(nd(g));
  for (auto& v : w.biases) v = 0.3f * nd(g);
  std::uniform_int_distribution<uint32_t> qd(0, (1u << bits) - 1u);
  for (size_t r = 0; r < rows; ++r)
    for (int k = 0; k < K; ++k) {
      const long bit = (long)k * bits;
      w.packed[r * (K * bits / 32) + bit / 32] |= qd(g) << (bit % 32);
    }
  return w;
}

// Runs `body(c)` for every warp of a launch of `bx_n` x `by_n` threadgroups of DS_IL_THREADS threads,
// one warp at a time, its 32 lanes as fibers (warp_fibers.h): every shuffle is met by all 32 lanes.
template <typename F>
static void launch(int bx_n, int by_n, F body) {
  const int NT = DS_IL_THREADS, WARPS = NT / 32;
  for (int by = 0; by < by_n; ++by)
    for (int bx = 0; bx < bx_n; ++bx)
      for (int warp = 0; warp < WARPS; ++warp)
        warp_fibers::run_warp([&](int lane) {
          ds_ctx c;
          c.tid = warp * 32 + lane; c.nthreads = NT; c.bx = bx; c.by = by;
          body(c);
        });
}

// The gather body over one or two expert weights of one kind (a, b; b may be null): outputs [P * M * N_g].
static std::vector<std::vector<float>> gather2(const Experts& a, const Experts* b, const float* x, const uint32_t* idx,
                                               int P, int M, int rep) {
  const int COLS = DS_IL_THREADS / 32;
  const Experts& w1 = b ? *b : a;
  const int N1 = b ? b->N : 0;
  std::vector<std::vector<float>> out{std::vector<float>((size_t)P * M * a.N, NAN),
                                      std::vector<float>((size_t)P * M * (b ? b->N : 0), NAN)};
  float* o0 = out[0].data();
  float* o1 = b ? out[1].data() : o0;
  const int R = P * M;
  launch((a.N + N1 + COLS - 1) / COLS, (R + DS_IL_ROWS - 1) / DS_IL_ROWS, [&](ds_ctx c) {
#define IG_AFFINE(BB, GG)                                                                                         \
  ds_ig_affine<float, BB, GG>(c, x, idx, a.packed.data(), a.scales.data(), a.biases.data(), w1.packed.data(),      \
                              w1.scales.data(), w1.biases.data(), o0, o1, P, M, a.N, N1, a.K, a.E, rep, a.group)
    if (!a.bits) {
      if (b) ds_ig_dense<float, 2>(c, x, idx, a.dense.data(), w1.dense.data(), o0, o1, P, M, a.N, N1, a.K, a.E, rep);
      else ds_ig_dense<float, 1>(c, x, idx, a.dense.data(), a.dense.data(), o0, o0, P, M, a.N, 0, a.K, a.E, rep);
    } else if (a.bits == 2) {
      if (b) IG_AFFINE(2, 2); else IG_AFFINE(2, 1);
    } else if (a.bits == 4) {
      if (b) IG_AFFINE(4, 2); else IG_AFFINE(4, 1);
    } else {
      if (b) IG_AFFINE(8, 2); else IG_AFFINE(8, 1);
    }
  });
  return out;
}

static std::vector<float> gather(const Experts& w, const float* x, const uint32_t* idx, int P, int M, int rep) {
  return gather2(w, nullptr, x, idx, P, M, rep)[0];
}

// The dense body (invariant_linear.h) on one x row with expert e's weight alone: [N].
static std::vector<float> dense_alone(const Experts& w, int e, const float* xrow) {
  const int COLS = DS_IL_THREADS / 32;
  std::vector<float> out(w.N, NAN);
  float* o = out.data();
  const size_t rows = (size_t)e * w.N;
  const float* wd = w.bits ? nullptr : w.dense.data() + rows * w.K;
  const uint32_t* q = w.bits ? w.packed.data() + rows * (w.K * w.bits / 32) : nullptr;
  const float* s = w.bits ? w.scales.data() + rows * (w.K / w.group) : nullptr;
  const float* z = w.bits ? w.biases.data() + rows * (w.K / w.group) : nullptr;
  launch((w.N + COLS - 1) / COLS, 1, [&](ds_ctx c) {
    if (!w.bits) {
      ds_il_dense<float, 1, 0>(c, xrow, wd, wd, wd, o, o, o, o, o, o, 1, w.N, 0, 0, w.K);
    } else if (w.bits == 2) {
      ds_il_affine<float, 2, 1, 0>(c, xrow, q, s, z, q, s, z, q, s, z, o, o, o, o, o, o, 1, w.N, 0, 0, w.K, w.group);
    } else if (w.bits == 4) {
      ds_il_affine<float, 4, 1, 0>(c, xrow, q, s, z, q, s, z, q, s, z, o, o, o, o, o, o, 1, w.N, 0, 0, w.K, w.group);
    } else {
      ds_il_affine<float, 8, 1, 0>(c, xrow, q, s, z, q, s, z, q, s, z, o, o, o, o, o, o, 1, w.N, 0, 0, w.K, w.group);
    }
  });
  return out;
}

static bool same(const float* a, const float* b, int n) { return std::memcmp(a, b, sizeof(float) * n) == 0; }

// T tokens, k experts each. layout 0: x [T, M, K] shared by a token's k pairs (rep = k);
// layout 1: x [T * k, M, K], one per pair (rep = 1).
static int check(int E, int N, int K, int bits, int group, int k, int M, int layout, int T, std::mt19937& g) {
  const int P = T * k, rep = layout == 0 ? k : 1, XR = layout == 0 ? T : P;
  Experts w = make(E, N, K, bits, group, g);
  std::normal_distribution<float> nd;
  std::vector<float> x((size_t)XR * M * K);
  for (auto& v : x) v = nd(g);
  std::vector<uint32_t> idx(P);
  std::uniform_int_distribution<uint32_t> ed(0, E - 1);
  for (int t = 0; t < T; ++t)  // k distinct experts per token, as a router picks them
    for (int j = 0; j < k; ++j) {
      uint32_t e;
      do e = ed(g); while (std::find(idx.begin() + t * k, idx.begin() + t * k + j, e) != idx.begin() + t * k + j);
      idx[t * k + j] = e;
    }
  const char* what = layout == 0 ? "shared-x" : "per-pair-x";
  std::vector<float> full = gather(w, x.data(), idx.data(), P, M, rep);
  for (int p = 0; p < P; ++p)
    for (int m = 0; m < M; ++m) {
      const float* xr = x.data() + ((size_t)(p / rep) * M + m) * K;
      const float* got = &full[((size_t)p * M + m) * N];
      for (int n = 0; n < N; ++n) {  // (1)
        double ref = 0.0, mag = 0.0;
        for (int kk = 0; kk < K; ++kk) {
          const double t = (double)xr[kk] * (double)w.at(idx[p], n, kk);
          ref += t;
          mag += std::fabs(t);
        }
        if (!(std::fabs(got[n] - ref) <= 1e-5 * mag + 1e-6)) {
          std::printf("bits %d group %d %s: out[%d, %d, %d] = %.8g, expected %.8g\n", bits, group, what, p, m, n,
                      got[n], ref);
          return 1;
        }
      }
      std::vector<float> alone = dense_alone(w, (int)idx[p], xr);  // (2)
      if (!same(alone.data(), got, N)) {
        std::printf("bits %d group %d %s: pair %d row %d differs from the dense kernel on its expert\n", bits, group,
                    what, p, m);
        return 1;
      }
    }
  if (layout == 0) {  // (4): a second weight of other N in one launch: each output as that weight alone
    Experts up = make(E, N + 3, K, bits, group, g);
    auto both = gather2(w, &up, x.data(), idx.data(), P, M, rep);
    std::vector<float> alone = gather(up, x.data(), idx.data(), P, M, rep);
    if (!same(both[0].data(), full.data(), P * M * N) || !same(both[1].data(), alone.data(), P * M * up.N)) {
      std::printf("bits %d group %d %s: a two-weight launch differs from the weights alone\n", bits, group, what);
      return 1;
    }
  }
  for (int t = 1; t <= T; t += (t < 5 ? 1 : 4)) {  // (3): the first t tokens' pairs
    const int Pt = t * k;
    std::vector<float> part = gather(w, x.data(), idx.data(), Pt, M, rep);
    if (!same(part.data(), full.data(), Pt * M * N)) {
      std::printf("bits %d group %d %s: a %d-token call differs from the %d-token call\n", bits, group, what, t, T);
      return 1;
    }
  }
  if (layout == 1) {  // the sorted call: pairs reordered by expert, one x row per pair
    std::vector<int> order(P);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return idx[a] < idx[b]; });
    std::vector<float> xs((size_t)P * M * K);
    std::vector<uint32_t> is(P);
    for (int i = 0; i < P; ++i) {
      is[i] = idx[order[i]];
      std::memcpy(&xs[(size_t)i * M * K], &x[(size_t)order[i] * M * K], sizeof(float) * M * K);
    }
    std::vector<float> sorted = gather(w, xs.data(), is.data(), P, M, 1);
    for (int i = 0; i < P; ++i)
      if (!same(&sorted[(size_t)i * M * N], &full[(size_t)order[i] * M * N], M * N)) {
        std::printf("bits %d group %d: pair %d sorted differs from unsorted\n", bits, group, order[i]);
        return 1;
      }
  }
  return 0;
}

int main() {
  std::mt19937 g(21);
  for (int layout : {0, 1}) {
    if (check(4, 7, 72, 0, 0, 2, 1, layout, 17, g)) return 1;  // N not a multiple of 4 columns; K < one 256 step
    if (check(3, 5, 520, 0, 0, 2, 2, layout, 9, g)) return 1;  // K with a partial step; M = 2 rows per pair
  }
  for (int bits : {2, 4, 8})
    for (int group : {32, 64, 128})
      for (int layout : {0, 1})
        if ((layout == 0 || group == 64) && check(4, 4, 384, bits, group, 2, 1, layout, 6, g)) return 1;
  std::printf("OK\n");
  return 0;
}
