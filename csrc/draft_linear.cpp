// A drafter's linear layer on the CPU from float16 weight panels: y = x W^T (+ bias), x and y
// float32. Semantics: python/mlx_dspark/kernels/draft_linear.py (the pure-MLX reference and the
// packing).
//
// Why: a drafter pass multiplies a handful of rows (a block's 7 slots, a few context rows) by every
// weight once, so it streams the drafter's weights through the CPU once a round: the demo drafter's
// float32 layers and draft-vocabulary head are ~107 MB, about a fifth of what its target's decode
// step reads. Half-width weights halve that stream, and the panel layout lets every weight vector
// feed all of a tile's rows without horizontal sums (bench/results/cpu-ops.md).
//
// The panels: W [N, K] as ceil(N / 16) panels of [K, 16] float16 (column n of panel p is weight
// row 16p + n, zero past N), so one panel is one contiguous run that a tile reads front to back.
// A tile of up to 6 x rows keeps 6 x 2 accumulators of 8 columns; each step k broadcasts x[r, k]
// and adds it times the panel's row k (two 8-lane halves, widened from float16). Each output is one
// multiply-add chain over k = 0 .. K - 1 in order, whatever the tile, so a row's result does not
// depend on how many rows run together. Drafts need no exactness (the target verifies every one):
// the float16 rounding of the weights only moves the drafts.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <sstream>
#include <vector>

#include "dspark.h"
#include "cpu_pool.h"
#include "cpu_vec.h"

namespace dspark {

namespace {

constexpr int kPanel = 16;   // columns per panel
constexpr int kTileRows = 6;  // x rows per tile (12 accumulators + 2 weight vectors + 1 broadcast)

// out[r * 16 + c] = sum_k x[r, k] * panel[k, c], r < R.
using PanelTile = void (*)(const float* x, int64_t ldx, const uint16_t* panel, int K, float* out, int R);

float half_to_float(uint16_t h) {  // MLX's float16_t widens exactly
  mx::float16_t v;
  std::memcpy(&v, &h, sizeof v);
  return static_cast<float>(v);
}

void tile_portable(const float* x, int64_t ldx, const uint16_t* panel, int K, float* out, int R) {
  float acc[kTileRows][kPanel] = {};
  for (int k = 0; k < K; ++k) {
    float w[kPanel];
    for (int c = 0; c < kPanel; ++c) w[c] = half_to_float(panel[static_cast<int64_t>(k) * kPanel + c]);
    for (int r = 0; r < R; ++r) {
      const float xv = x[r * ldx + k];
      for (int c = 0; c < kPanel; ++c) acc[r][c] += xv * w[c];
    }
  }
  for (int r = 0; r < R; ++r) std::memcpy(out + r * kPanel, acc[r], sizeof acc[r]);
}

#ifdef DSPARK_X86
template <int R>
__attribute__((target("avx2,fma,f16c"))) void tile_avx2_rows(const float* x, int64_t ldx, const uint16_t* panel,
                                                             int K, float* out) {
  __m256 lo[R], hi[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
  const __m128i* p = reinterpret_cast<const __m128i*>(panel);
  for (int k = 0; k < K; ++k, p += 2) {
    const __m256 w0 = _mm256_cvtph_ps(_mm_loadu_si128(p)), w1 = _mm256_cvtph_ps(_mm_loadu_si128(p + 1));
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_broadcast_ss(x + r * ldx + k);
      lo[r] = _mm256_fmadd_ps(xv, w0, lo[r]);
      hi[r] = _mm256_fmadd_ps(xv, w1, hi[r]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(out + r * kPanel, lo[r]);
    _mm256_storeu_ps(out + r * kPanel + 8, hi[r]);
  }
}

void tile_avx2(const float* x, int64_t ldx, const uint16_t* panel, int K, float* out, int R) {
  switch (R) {
    case 1: return tile_avx2_rows<1>(x, ldx, panel, K, out);
    case 2: return tile_avx2_rows<2>(x, ldx, panel, K, out);
    case 3: return tile_avx2_rows<3>(x, ldx, panel, K, out);
    case 4: return tile_avx2_rows<4>(x, ldx, panel, K, out);
    case 5: return tile_avx2_rows<5>(x, ldx, panel, K, out);
    default: return tile_avx2_rows<6>(x, ldx, panel, K, out);
  }
}
#endif

struct PanelTiles {
  PanelTile tile;
  const char* name;
};

// AVX2 + FMA + F16C where the CPU has them, unless MLX_DSPARK_CPU_ISA=portable.
const PanelTiles& panel_tiles() {
  static const PanelTiles t = [] {
    const char* isa = std::getenv("MLX_DSPARK_CPU_ISA");
    const bool portable = isa != nullptr && std::strcmp(isa, "portable") == 0;
#ifdef DSPARK_X86
    if (!portable && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        __builtin_cpu_supports("f16c"))
      return PanelTiles{tile_avx2, "avx2"};
#endif
    (void)portable;
    return PanelTiles{tile_portable, "portable"};
  }();
  return t;
}

// Rows of x per block: a block's rows stay in the cache while every panel passes over them.
constexpr int kBlockRows = 8 * kTileRows;

void panel_linear(const float* x, const uint16_t* panels, const float* bias, float* y, int M, int N, int K) {
  const PanelTile tile = panel_tiles().tile;
  const int P = (N + kPanel - 1) / kPanel;
  const int64_t panel_elems = static_cast<int64_t>(K) * kPanel;
  cpu::Pool& pool = cpu::Pool::get();
  for (int m_block = 0; m_block < M; m_block += kBlockRows) {
    const int rows = std::min(kBlockRows, M - m_block);
    const int tasks = std::min(P, pool.size() * 4);
    pool.run(tasks, [&](int t) {
      const int p0 = static_cast<int>(static_cast<int64_t>(P) * t / tasks);
      const int p1 = static_cast<int>(static_cast<int64_t>(P) * (t + 1) / tasks);
      float out[kTileRows * kPanel];
      for (int p = p0; p < p1; ++p) {
        const uint16_t* panel = panels + p * panel_elems;
        const int n0 = p * kPanel, cols = std::min(kPanel, N - n0);
        // The block's rows in tiles of near-equal height (7 rows: 4 + 3, not 6 + 1): a short
        // tile has few accumulator chains and waits on the multiply-add latency.
        const int n_tiles = (rows + kTileRows - 1) / kTileRows;
        for (int t = 0, m0 = m_block; t < n_tiles; ++t) {
          const int r = rows / n_tiles + (t < rows % n_tiles ? 1 : 0);
          tile(x + static_cast<int64_t>(m0) * K, K, panel, K, out, r);
          for (int i = 0; i < r; ++i) {
            float* yrow = y + static_cast<int64_t>(m0 + i) * N + n0;
            for (int c = 0; c < cols; ++c) yrow[c] = bias ? out[i * kPanel + c] + bias[n0 + c] : out[i * kPanel + c];
          }
          m0 += r;
        }
      }
    });
  }
}

}  // namespace

const char* draft_linear_isa() { return panel_tiles().name; }

mx::array draft_linear(const mx::array& x, const mx::array& panels, const std::optional<mx::array>& bias, int n,
                       mx::StreamOrDevice s) {
  constexpr const char* op = "draft_linear";
  auto st = cpu::cpu_stream(op, s);
  cpu::need_f32(op, x, "x");
  if (panels.dtype() != mx::float16) cpu::fail(op, "panels must be float16 (kernels/draft_linear.py: pack)");
  if (x.ndim() != 2 || panels.ndim() != 3 || panels.shape(2) != kPanel)
    cpu::fail(op, "x must be [M, K] and panels [ceil(N / 16), K, 16]");
  const int K = x.shape(1);
  if (panels.shape(1) != K || n < 1 || (n + kPanel - 1) / kPanel != panels.shape(0)) {
    std::ostringstream m;
    m << "x has K = " << K << "; panels [" << panels.shape(0) << ", " << panels.shape(1) << ", 16] do not hold "
      << n << " rows of K";
    cpu::fail(op, m.str());
  }
  std::vector<mx::array> inputs = {mx::contiguous(x, false, st), mx::contiguous(panels, false, st)};
  if (bias) {
    if (bias->ndim() != 1 || bias->shape(0) != n) cpu::fail(op, "bias must be [n]");
    inputs.push_back(mx::contiguous(mx::astype(*bias, mx::float32, st), false, st));
  }
  return mx::array({x.shape(0), n}, mx::float32, std::make_shared<DraftLinear>(st, bias.has_value()), inputs);
}

void DraftLinear::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& out = outputs[0];
  cpu::begin(stream(), inputs, out);
  const int M = inputs[0].shape(0), K = inputs[0].shape(1), N = out.shape(1);
  mx::cpu::get_command_encoder(stream()).dispatch(
      [xp = inputs[0].data<float>(), pp = reinterpret_cast<const uint16_t*>(inputs[1].data<mx::float16_t>()),
       bp = has_bias_ ? inputs[2].data<float>() : nullptr, yp = out.data<float>(), M, N, K]() {
        panel_linear(xp, pp, bp, yp, M, N, K);
      });
}

void DraftLinear::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error(
      "[dspark.draft_linear] runs on the CPU; other devices run the drafter's own weights "
      "(mlx_dspark.kernels.draft_linear)");
}

}  // namespace dspark
