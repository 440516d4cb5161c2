// Vector helpers of the CPU kernels (draft_ops.cpp, invariant_attention.cpp): a polynomial exp,
// dot products, axpy and the softmax's exp-and-sum, AVX2 + FMA where the CPU has both (chosen once
// per process by vec()), portable otherwise; and the shared checks of a CPU primitive's inputs.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "dspark.h"
#include "invariant_linear_tiles.h"  // DSPARK_X86, <immintrin.h>
#include "mlx/backend/cpu/encoder.h"

namespace dspark::cpu {

// Multiply-adds below which an attention op runs on the calling thread alone (waking the pool's
// workers costs more than they save).
constexpr int64_t kParallelWork = int64_t{1} << 20;

// ---------------------------------------------------------------------------- vector helpers
#ifdef DSPARK_X86
// e^x, 8 lanes: 2^n * p(r), n = round(x log2 e), r = x - n ln 2 (two-part ln 2), p Cephes' degree-6
// polynomial of expf; x clamped to [-87.3, 88.7] (below: ~1e-38, not 0).
__attribute__((target("avx2,fma"))) inline __m256 exp_avx2(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.7f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

__attribute__((target("avx2,fma"))) inline float hsum_avx2(__m256 v) {
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}

__attribute__((target("avx2,fma"))) inline float dot_avx2(const float* a, const float* b, int n) {
  __m256 acc = _mm256_setzero_ps();
  int i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  float s = hsum_avx2(acc);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// y += a * x
__attribute__((target("avx2,fma"))) inline void axpy_avx2(float a, const float* x, float* y, int n) {
  const __m256 va = _mm256_set1_ps(a);
  int i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  for (; i < n; ++i) y[i] += a * x[i];
}

// x[i] = exp(x[i] - m), returns the sum
__attribute__((target("avx2,fma"))) inline float exp_shift_sum_avx2(float* x, float m, int n) {
  const __m256 vm = _mm256_set1_ps(m);
  __m256 acc = _mm256_setzero_ps();
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(x + i), vm));
    _mm256_storeu_ps(x + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  float s = hsum_avx2(acc);
  for (; i < n; ++i) {
    x[i] = std::exp(x[i] - m);
    s += x[i];
  }
  return s;
}

// The Markov chain's step: argmax over c of u[c] + w2[c] . e (r floats each), in mx.argmax's order
// (the larger value, the smaller index on a tie, NaN first). Eight rows at a time: their dot
// products are reduced together by a tree of horizontal adds, and each lane keeps its own best.
__attribute__((target("avx2,fma"))) inline int markov_argmax_avx2(const float* u, const float* w2, const float* e, int Vd,
                                                           int r) {
  if (r % 8 != 0 || r > 256) return -1;  // the portable step runs
  const int kb = r / 8;
  __m256 ev[32];
  for (int k = 0; k < kb; ++k) ev[k] = _mm256_loadu_ps(e + 8 * k);
  __m256 best_v = _mm256_set1_ps(-INFINITY);
  __m256i best_i = _mm256_set1_epi32(-1);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  int c = 0;
  for (; c + 8 <= Vd; c += 8) {
    __m256 acc[8];
    for (int i = 0; i < 8; ++i) {
      const float* w = w2 + static_cast<int64_t>(c + i) * r;
      acc[i] = _mm256_mul_ps(_mm256_loadu_ps(w), ev[0]);
      for (int k = 1; k < kb; ++k) acc[i] = _mm256_fmadd_ps(_mm256_loadu_ps(w + 8 * k), ev[k], acc[i]);
    }
    const __m256 t01 = _mm256_hadd_ps(acc[0], acc[1]), t23 = _mm256_hadd_ps(acc[2], acc[3]);
    const __m256 t45 = _mm256_hadd_ps(acc[4], acc[5]), t67 = _mm256_hadd_ps(acc[6], acc[7]);
    const __m256 q0 = _mm256_hadd_ps(t01, t23), q1 = _mm256_hadd_ps(t45, t67);
    const __m256 sums = _mm256_add_ps(_mm256_permute2f128_ps(q0, q1, 0x20), _mm256_permute2f128_ps(q0, q1, 0x31));
    const __m256 z = _mm256_add_ps(sums, _mm256_loadu_ps(u + c));
    const __m256 nan = _mm256_cmp_ps(z, z, _CMP_UNORD_Q);
    if (_mm256_movemask_ps(nan)) {
      alignas(32) float zs[8];
      _mm256_store_ps(zs, z);
      for (int i = 0; i < 8; ++i)
        if (std::isnan(zs[i])) return c + i;
    }
    const __m256 gt = _mm256_cmp_ps(z, best_v, _CMP_GT_OQ);  // strict: a lane keeps its first best
    best_v = _mm256_blendv_ps(best_v, z, gt);
    best_i = _mm256_blendv_epi8(best_i, _mm256_add_epi32(lane, _mm256_set1_epi32(c)), _mm256_castps_si256(gt));
  }
  alignas(32) float bv[8];
  alignas(32) int32_t bi[8];
  _mm256_store_ps(bv, best_v);
  _mm256_store_si256(reinterpret_cast<__m256i*>(bi), best_i);
  int best = -1;
  float b = -INFINITY;
  for (int i = 0; i < 8; ++i)
    if (bi[i] >= 0 && (best < 0 || bv[i] > b || (bv[i] == b && bi[i] < best))) best = bi[i], b = bv[i];
  for (; c < Vd; ++c) {
    const float z = u[c] + dot_avx2(w2 + static_cast<int64_t>(c) * r, e, r);
    if (std::isnan(z)) return c;
    if (best < 0 || z > b) best = c, b = z;
  }
  return best < 0 ? 0 : best;  // every value -inf: index 0, as mx.argmax
}

__attribute__((target("avx2,fma"))) inline void silu_mul_avx2(const float* g, const float* u, float* y, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.0f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 vg = _mm256_loadu_ps(g + i);
    const __m256 den = _mm256_add_ps(one, exp_avx2(_mm256_sub_ps(_mm256_setzero_ps(), vg)));
    _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_div_ps(vg, den), _mm256_loadu_ps(u + i)));
  }
  for (; i < n; ++i) y[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
}
#endif

inline float dot_portable(const float* a, const float* b, int n) {
  float s = 0.0f;
  for (int i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

inline void axpy_portable(float a, const float* x, float* y, int n) {
  for (int i = 0; i < n; ++i) y[i] += a * x[i];
}

inline float exp_shift_sum_portable(float* x, float m, int n) {
  float s = 0.0f;
  for (int i = 0; i < n; ++i) {
    x[i] = std::exp(x[i] - m);
    s += x[i];
  }
  return s;
}

inline void silu_mul_portable(const float* g, const float* u, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
}

inline int markov_argmax_portable(const float*, const float*, const float*, int, int) { return -1; }

struct Vec {
  int (*markov_argmax)(const float*, const float*, const float*, int, int);  // -1: not this r
  float (*dot)(const float*, const float*, int);
  void (*axpy)(float, const float*, float*, int);
  float (*exp_shift_sum)(float*, float, int);
  void (*silu_mul)(const float*, const float*, float*, int64_t);
  const char* name;
};

// MLX_DSPARK_CPU_ISA=portable picks the portable set on any CPU (tests cover it that way).
inline const Vec& vec() {
  static const Vec v = [] {
    const char* isa = std::getenv("MLX_DSPARK_CPU_ISA");
    const bool portable = isa != nullptr && std::string(isa) == "portable";
#ifdef DSPARK_X86
    if (!portable && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
      return Vec{markov_argmax_avx2, dot_avx2, axpy_avx2, exp_shift_sum_avx2, silu_mul_avx2, "avx2"};
#endif
    (void)portable;
    return Vec{markov_argmax_portable, dot_portable, axpy_portable,
               exp_shift_sum_portable, silu_mul_portable, "portable"};
  }();
  return v;
}

[[noreturn]] inline void fail(const char* op, const std::string& what) {
  throw std::invalid_argument(std::string("[dspark.") + op + "] " + what);
}

inline mx::Stream cpu_stream(const char* op, mx::StreamOrDevice s) {
  auto st = mx::to_stream(s);
  if (st.device != mx::Device::cpu) fail(op, "runs on the CPU (other devices run the op's pure-MLX reference)");
  return st;
}

inline void need_f32(const char* op, const mx::array& a, const char* name) {
  if (a.dtype() != mx::float32) fail(op, std::string(name) + " must be float32");
}

inline void begin(const mx::Stream& stream, const std::vector<mx::array>& inputs, mx::array& out) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& enc = mx::cpu::get_command_encoder(stream);
  for (const auto& a : inputs) enc.set_input_array(a);
  enc.set_output_array(out);
}

// An input that may not be row-contiguous, read inside a dispatched task: its elements in row order,
// from its own memory where they already lie so, else copied once through its strides. Taking
// strided inputs this way saves a graph node (mx::contiguous) per call.
struct RowOrder {
  const char* base;
  size_t itemsize, size;
  bool contiguous;
  std::vector<int> shape;
  std::vector<int64_t> strides;

  explicit RowOrder(const mx::array& a)
      : base(a.data<char>()), itemsize(a.itemsize()), size(a.size()), contiguous(a.flags().row_contiguous),
        shape(a.shape().begin(), a.shape().end()), strides(a.strides().begin(), a.strides().end()) {}

  // The elements in row order: `base` itself, or `buf` filled (runs of the last axis at once).
  const void* get(std::vector<char>& buf) const {
    if (contiguous || size == 0) return base;
    buf.resize(size * itemsize);
    const int nd = static_cast<int>(shape.size());
    const int64_t last = nd ? shape[nd - 1] : 1, step = nd ? strides[nd - 1] : 1;
    std::vector<int> idx(nd > 0 ? nd - 1 : 0, 0);
    char* out = buf.data();
    for (size_t done = 0; done < size; done += last) {
      int64_t off = 0;
      for (int d = 0; d + 1 < nd; ++d) off += idx[d] * strides[d];
      const char* src = base + off * static_cast<int64_t>(itemsize);
      if (step == 1) {
        std::memcpy(out, src, last * itemsize);
      } else {
        for (int64_t j = 0; j < last; ++j) std::memcpy(out + j * itemsize, src + j * step * itemsize, itemsize);
      }
      out += last * itemsize;
      for (int d = nd - 2; d >= 0; --d) {  // the next row's index
        if (++idx[d] < shape[d]) break;
        idx[d] = 0;
      }
    }
    return buf.data();
  }
};

// `a` itself where it is evaluated and row-contiguous (weights, biases), else mx::contiguous(a).
inline mx::array as_contiguous(const mx::array& a, const mx::Stream& st) {
  return a.is_available() && a.flags().row_contiguous ? a : mx::contiguous(a, false, st);
}

}  // namespace dspark::cpu
