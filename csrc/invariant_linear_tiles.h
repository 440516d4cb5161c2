// Register tiles of the width-invariant dense linear (invariant_linear.cpp): R rows of x against
// C weight rows, every weight vector loaded once per tile and used by all R rows.
//
// The one recipe of an output element, whatever tile computes it:
//   acc[0..7] = 0
//   for k0 = 0, 8, 16, ... < K:  acc[j] = acc[j] + x[k0 + j] * w[k0 + j]   (j = 0..7; past K: no term)
//   s4[j] = acc[j] + acc[j + 4];  s2[j] = s4[j] + s4[j + 2];  dot = s2[0] + s2[1]
// With AVX2 the step is one fused multiply-add (8 lanes, the last step's missing lanes zero); the
// portable tiles do it as a multiply then an add (the file is built with -ffp-contract=off, so no
// compiler may fuse some instances and not others). Tiles differ only in how many independent
// elements they run side by side, never in the operations of one element, so a row of an M-row
// call is bit-identical to the row alone. No header of MLX here: bench/tests may build it alone.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define DSPARK_X86 1
#endif

namespace dspark::il {

constexpr int kLanes = 8;

// out[r * C + c] = dot(x row r, w[c]); x rows are ldx floats apart.
using TileFn = void (*)(const float* x, int64_t ldx, const float* const* w, int K, float* out);

inline float reduce_lanes(const float a[kLanes]) {
  float s4[4], s2[2];
  for (int j = 0; j < 4; ++j) s4[j] = a[j] + a[j + 4];
  for (int j = 0; j < 2; ++j) s2[j] = s4[j] + s4[j + 2];
  return s2[0] + s2[1];
}

template <int R, int C>
void tile_portable(const float* x, int64_t ldx, const float* const* w, int K, float* out) {
  float acc[R][C][kLanes] = {};
  int k = 0;
  for (; k + kLanes <= K; k += kLanes)
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c)
        for (int j = 0; j < kLanes; ++j) acc[r][c][j] = acc[r][c][j] + x[r * ldx + k + j] * w[c][k + j];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c)
      for (int j = 0; k + j < K; ++j) acc[r][c][j] = acc[r][c][j] + x[r * ldx + k + j] * w[c][k + j];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) out[r * C + c] = reduce_lanes(acc[r][c]);
}

#ifdef DSPARK_X86
// s4 = lanes j + j+4, s2 = s4[j] + s4[j+2], then s2[0] + s2[1]: reduce_lanes in SSE.
__attribute__((target("avx2,fma"))) inline float reduce_lanes_avx2(__m256 v) {
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}

template <int R, int C>
__attribute__((target("avx2,fma"))) void tile_avx2(const float* x, int64_t ldx, const float* const* w, int K,
                                                   float* out) {
  __m256 acc[R][C];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  const float* wc[C];
#pragma GCC unroll 16
  for (int c = 0; c < C; ++c) wc[c] = w[c];
  int k = 0;
  for (; k + kLanes <= K; k += kLanes) {
    __m256 xv[R];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) xv[r] = _mm256_loadu_ps(x + r * ldx + k);
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) {
      const __m256 wv = _mm256_loadu_ps(wc[c] + k);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) acc[r][c] = _mm256_fmadd_ps(xv[r], wv, acc[r][c]);
    }
  }
  if (k < K) {  // the last step: the lanes past K load as zero and add 0 * 0
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(K - k), lane);
    __m256 xv[R];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) xv[r] = _mm256_maskload_ps(x + r * ldx + k, mask);
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) {
      const __m256 wv = _mm256_maskload_ps(wc[c] + k, mask);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) acc[r][c] = _mm256_fmadd_ps(xv[r], wv, acc[r][c]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) out[r * C + c] = reduce_lanes_avx2(acc[r][c]);
}
#endif

// One instruction set's tiles: `rows` rows of x at a time against `cols` weight rows, and a tile
// for each remainder 1 .. rows - 1 (row_tail[r - 1]), all with `cols` weight rows.
struct Tiles {
  const char* name;
  int rows, cols;
  TileFn full;
  TileFn row_tail[3];
};

constexpr int kMaxRows = 4, kMaxCols = 4;

inline Tiles portable_tiles() {
  return {"portable", 2, 4, tile_portable<2, 4>, {tile_portable<1, 4>, nullptr, nullptr}};
}

#ifdef DSPARK_X86
// 3 x 4: 12 accumulators + 3 x vectors + 1 weight vector = the 16 ymm registers; 7 loads per 12
// fused multiply-adds (one-row-at-a-time: 5 per 4).
inline Tiles avx2_tiles() {
  return {"avx2", 3, 4, tile_avx2<3, 4>, {tile_avx2<1, 4>, tile_avx2<2, 4>, nullptr}};
}
#endif

// Picked once per process: AVX2 + FMA where the CPU has both, unless MLX_DSPARK_CPU_ISA=portable
// (tests run the portable tiles so; the two sets agree to rounding, not bitwise).
inline const Tiles& tiles() {
  static const Tiles t = [] {
    const char* isa = std::getenv("MLX_DSPARK_CPU_ISA");
    if (isa && std::strcmp(isa, "portable") == 0) return portable_tiles();
#ifdef DSPARK_X86
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return avx2_tiles();
#endif
    return portable_tiles();
  }();
  return t;
}

}  // namespace dspark::il
