// Runs the GPU body kernels/gpu/invariant_linear.h on the CPU: the Metal branch of ds_portable.h,
// one warp at a time, its 32 lanes as fibers (warp_fibers.h; every shuffle in the body is called by all
// 32 lanes of a warp). Weights are packed in MLX's
// affine layout here. Checks, for a dense weight and for bits 2, 4, 8 at groups 32, 64, 128:
// (1) the output against a double-precision product, (2) bitwise width invariance: row i of an
// M-row call equals the same row alone, for M = 1..17, (3) three weights in one launch give what
// each gives alone, bitwise. Prints "OK" and exits 0, else the failure.
#include "metal_emu.h"
#include "invariant_linear.h"
#undef thread
#undef device
#undef threadgroup
#include "warp_fibers.h"

struct Weights {
  int N, K, bits, group;  // bits 0: dense
  std::vector<float> dense, scales, biases;
  std::vector<uint32_t> packed;
  float at(int n, int k) const {  // the weight value the kernel should see
    if (!bits) return dense[(size_t)n * K + k];
    const long bit = (long)k * bits;
    const uint32_t q = (packed[(size_t)n * (K * bits / 32) + bit / 32] >> (bit % 32)) & ((1u << bits) - 1u);
    const int g = k / group;
    return scales[(size_t)n * (K / group) + g] * (float)q + biases[(size_t)n * (K / group) + g];
  }
};

static Weights make(int N, int K, int bits, int group, std::mt19937& g) {
  Weights w{N, K, bits, group, {}, {}, {}, {}};
  std::normal_distribution<float> nd;
  if (!bits) {
    w.dense.resize((size_t)N * K);
    for (auto& v : w.dense) v = nd(g);
    return w;
  }
  w.packed.assign((size_t)N * K * bits / 32, 0u);
  w.scales.resize((size_t)N * K / group);
  w.biases.resize((size_t)N * K / group);
  for (auto& v : w.scales) v = 0.01f + 0.1f * std::fabs(nd(g));
  for (auto& v : w.biases) v = 0.3f * nd(g);
  std::uniform_int_distribution<uint32_t> qd(0, (1u << bits) - 1u);
  for (int n = 0; n < N; ++n)
    for (int k = 0; k < K; ++k) {
      const long bit = (long)k * bits;
      w.packed[(size_t)n * (K * bits / 32) + bit / 32] |= qd(g) << (bit % 32);
    }
  return w;
}

// Weights ws (1..3, one kind) over one input in one launch; outputs [g][M * N_g].
static std::vector<std::vector<float>> run_group(const std::vector<const Weights*>& ws, const float* x, int M,
                                                 const std::vector<const float*>& bias) {
  const int NT = DS_IL_THREADS, COLS = NT / 32, G = (int)ws.size();
  std::vector<std::vector<float>> out(3);
  int Ntot = 0;
  for (int g = 0; g < G; ++g) {
    out[g].assign((size_t)M * ws[g]->N, NAN);
    Ntot += ws[g]->N;
  }
  int hb = 0;
  for (int g = 0; g < G; ++g) hb |= bias[g] ? 1 << g : 0;
  auto W = [&](int g) { return ws[g < G ? g : 0]; };
  auto B = [&](int g) { return bias[g < G ? g : 0]; };
  auto O = [&](int g) { return out[g < G ? g : 0].data(); };
  const int N1 = G > 1 ? ws[1]->N : 0, N2 = G > 2 ? ws[2]->N : 0;
  const Weights& w = *ws[0];
  const int blocks = (Ntot + COLS - 1) / COLS;
  for (int bx = 0; bx < blocks; ++bx)
    for (int warp = 0; warp < COLS; ++warp) {
      if (bx * COLS + warp >= Ntot) continue;  // the body returns whole warps past the columns
      warp_fibers::run_warp([&](int lane) {
        ds_ctx c;
        c.tid = warp * 32 + lane; c.nthreads = NT; c.bx = bx; c.by = 0;
#define IL_DENSE(GG, HB) ds_il_dense<float, GG, HB>(c, x, W(0)->dense.data(), W(1)->dense.data(), W(2)->dense.data(), \
    B(0), B(1), B(2), O(0), O(1), O(2), M, w.N, N1, N2, w.K)
#define IL_AFFINE(BB, GG, HB) ds_il_affine<float, BB, GG, HB>(c, x, \
    W(0)->packed.data(), W(0)->scales.data(), W(0)->biases.data(), W(1)->packed.data(), W(1)->scales.data(), \
    W(1)->biases.data(), W(2)->packed.data(), W(2)->scales.data(), W(2)->biases.data(), B(0), B(1), B(2), \
    O(0), O(1), O(2), M, w.N, N1, N2, w.K, w.group)
        if (!w.bits) {
          if (G == 1 && hb == 1) IL_DENSE(1, 1);
          else if (G == 1) IL_DENSE(1, 0);
          else IL_DENSE(3, 5);  // the group check: biases on weights 0 and 2
        } else if (w.bits == 2) {
          if (G == 1) IL_AFFINE(2, 1, 0); else IL_AFFINE(2, 3, 5);
        } else if (w.bits == 4) {
          if (G == 1 && hb == 1) IL_AFFINE(4, 1, 1); else if (G == 1) IL_AFFINE(4, 1, 0); else IL_AFFINE(4, 3, 5);
        } else {
          if (G == 1) IL_AFFINE(8, 1, 0); else IL_AFFINE(8, 3, 5);
        }
      });
    }
  out.resize(G);
  return out;
}

static std::vector<float> run(const Weights& w, const float* x, int M, const float* bias) {
  return run_group({&w}, x, M, {bias})[0];
}

// Three weights in one launch give, column for column, what each gives alone (bitwise).
static int check_group(int K, int bits, int group, std::mt19937& g) {
  Weights a = make(9, K, bits, group, g), b = make(3, K, bits, group, g), c = make(6, K, bits, group, g);
  std::normal_distribution<float> nd;
  const int M = 6;
  std::vector<float> x((size_t)M * K), ba(9), bc(6);
  for (auto& v : x) v = nd(g);
  for (auto& v : ba) v = nd(g);
  for (auto& v : bc) v = nd(g);
  auto outs = run_group({&a, &b, &c}, x.data(), M, {ba.data(), nullptr, bc.data()});
  const bool alone_bias = bits == 0 || bits == 4;  // the single-weight instances run above
  const Weights* ws[3] = {&a, &b, &c};
  const float* bs[3] = {ba.data(), nullptr, bc.data()};
  for (int i = 0; i < 3; ++i) {
    if (bs[i] && !alone_bias) continue;
    std::vector<float> one = run(*ws[i], x.data(), M, bs[i]);
    if (std::memcmp(one.data(), outs[i].data(), sizeof(float) * one.size()) != 0) {
      std::printf("bits %d group %d: weight %d of a 3-weight launch differs from the weight alone\n", bits, group, i);
      return 1;
    }
  }
  return 0;
}

static int check(int N, int K, int bits, int group, std::mt19937& g) {
  const int MAXM = 17;
  Weights w = make(N, K, bits, group, g);
  std::normal_distribution<float> nd;
  std::vector<float> x((size_t)MAXM * K), bias(N);
  for (auto& v : x) v = nd(g);
  for (auto& v : bias) v = nd(g);
  const bool has_bias = bits == 0 || bits == 4;  // the instances run above
  const float* bp = has_bias ? bias.data() : nullptr;
  std::vector<float> full = run(w, x.data(), MAXM, bp);
  for (int m = 0; m < MAXM; ++m)
    for (int n = 0; n < N; ++n) {
      double ref = has_bias ? bias[n] : 0.0, mag = std::fabs(ref);
      for (int k = 0; k < K; ++k) {
        const double t = (double)x[(size_t)m * K + k] * (double)w.at(n, k);
        ref += t;
        mag += std::fabs(t);
      }
      const double got = full[(size_t)m * N + n];
      if (!(std::fabs(got - ref) <= 1e-5 * mag + 1e-6)) {
        std::printf("bits %d group %d: out[%d, %d] = %.8g, expected %.8g\n", bits, group, m, n, got, ref);
        return 1;
      }
    }
  for (int M = 1; M <= MAXM; M += (M < 4 ? 1 : 6)) {  // M = 1, 2, 3, 4, 10, 16 rows from row i on
    for (int i = 0; i + M <= MAXM; i += 5) {
      std::vector<float> part = run(w, x.data() + (size_t)i * K, M, bp);
      for (int m = 0; m < M; ++m)
        if (std::memcmp(&part[(size_t)m * N], &full[(size_t)(i + m) * N], sizeof(float) * N) != 0) {
          std::printf("bits %d group %d: row %d of a %d-row call differs from row %d of the %d-row call\n", bits,
                      group, m, M, i + m, MAXM);
          return 1;
        }
    }
  }
  return 0;
}

int main() {
  std::mt19937 g(11);
  if (check(7, 72, 0, 0, g)) return 1;       // N not a multiple of the 4 columns a group takes
  if (check(5, 520, 0, 0, g)) return 1;      // K past one 256-element step, not a multiple of it
  for (int bits : {2, 4, 8})
    for (int group : {32, 64, 128})
      if (check(6, 384, bits, group, g)) return 1;
  if (check_group(136, 0, 0, g)) return 1;
  for (int bits : {2, 4, 8})
    if (check_group(256, bits, 64, g)) return 1;
  std::printf("OK\n");
  return 0;
}
