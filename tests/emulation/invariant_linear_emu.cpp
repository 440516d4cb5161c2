// Runs the GPU body kernels/gpu/invariant_linear.h on the CPU: the Metal branch of ds_portable.h,
// one std::thread per lane of a warp, SIMD shuffles through a shared slot array behind a barrier
// (every shuffle in the body is called by all 32 lanes of a warp). Weights are packed in MLX's
// affine layout here. Checks, for a dense weight and for bits 2, 4, 8 at groups 32, 64, 128:
// (1) the output against a double-precision product, (2) bitwise width invariance: row i of an
// M-row call equals the same row alone, for M = 1..17. Prints "OK" and exits 0, else the failure.
#include "metal_emu.h"
#include "invariant_linear.h"
#undef thread
#undef device
#undef threadgroup

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

static std::vector<float> run(const Weights& w, const float* x, int M, const float* bias) {
  const int NT = DS_IL_THREADS, COLS = NT / 32;
  std::vector<float> out((size_t)M * w.N, NAN);
  const int blocks = (w.N + COLS - 1) / COLS;
  for (int bx = 0; bx < blocks; ++bx)
    for (int warp = 0; warp < COLS; ++warp) {
      if (bx * COLS + warp >= w.N) continue;  // the body returns whole warps past N
      std::barrier<> bar(32);
      g_bar = &bar;
      std::vector<std::thread> th;
      for (int lane = 0; lane < 32; ++lane)
        th.emplace_back([&, lane] {
          t_tid = lane;
          ds_ctx c;
          c.tid = warp * 32 + lane; c.nthreads = NT; c.bx = bx; c.by = 0;
          if (!w.bits) {
            if (bias) ds_il_dense<float, true>(c, x, w.dense.data(), bias, out.data(), M, w.N, w.K);
            else ds_il_dense<float, false>(c, x, w.dense.data(), bias, out.data(), M, w.N, w.K);
          } else if (w.bits == 2) {
            ds_il_affine<float, 2, false>(c, x, w.packed.data(), w.scales.data(), w.biases.data(), bias, out.data(),
                                          M, w.N, w.K, w.group);
          } else if (w.bits == 4) {
            ds_il_affine<float, 4, true>(c, x, w.packed.data(), w.scales.data(), w.biases.data(), bias, out.data(), M,
                                         w.N, w.K, w.group);
          } else {
            ds_il_affine<float, 8, false>(c, x, w.packed.data(), w.scales.data(), w.biases.data(), bias, out.data(),
                                          M, w.N, w.K, w.group);
          }
        });
      for (auto& t : th) t.join();
    }
  return out;
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
  std::printf("OK\n");
  return 0;
}
