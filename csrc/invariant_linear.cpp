// Width-invariant dense linear, y = x W^T (+ bias): the op and its CPU evaluation.
// Semantics: python/mlx_dspark/kernels/invariant_linear.py::invariant_linear_reference.
//
// Every output y[m, n] is one fixed-order dot product of x row m with weight row n, then the
// bias, so row m of an M-row call is bit-identical to the row alone. Two kernels:
//   tiled (the default)  register tiles of a few x rows against a few weight rows
//                        (invariant_linear_tiles.h: 8 float lanes over k, a fixed lane tree): each
//                        weight vector is loaded once per tile and used by every row of it, so
//                        the cost grows with M at the FMA rate rather than the load rate.
//   rows                 the first kernel, kept as the microbenchmark's baseline: four weight
//                        rows per pass, each x row alone against them (16 lanes, another tree).
// Both read each weight row from memory once for all M rows (in passes split over a few
// threads) and neither lets M change the operations of an output element. On x86-64 the dot
// products are AVX2 + FMA where the CPU has both (chosen once per process), portable otherwise.
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <thread>
#include <vector>

#include "dspark.h"
#include "cpu_pool.h"
#include "cpu_vec.h"
#include "invariant_linear_tiles.h"
#include "mlx/backend/cpu/encoder.h"

namespace dspark {

namespace {

constexpr int kLanes = 16;  // float lanes of one dot product
constexpr int kRows = 4;    // weight rows per pass

// Adds the 16 lanes by a fixed tree, then the tail.
inline float finish(float acc[kLanes], const float* x, const float* w, int k, int K) {
  for (int s = kLanes / 2; s > 0; s >>= 1)
    for (int j = 0; j < s; ++j) acc[j] += acc[j + s];
  float tail = 0.0f;
  for (; k < K; ++k) tail += x[k] * w[k];
  return acc[0] + tail;
}

using Dot4 = void (*)(const float* x, const float* const* w, int K, float* out);

void dot4_portable(const float* x, const float* const* w, int K, float* out) {
  for (int r = 0; r < kRows; ++r) {
    float acc[kLanes] = {};
    int k = 0;
    for (; k + kLanes <= K; k += kLanes)
      for (int j = 0; j < kLanes; ++j) acc[j] += x[k + j] * w[r][k + j];
    out[r] = finish(acc, x, w[r], k, K);
  }
}

#ifdef DSPARK_X86
__attribute__((target("avx2,fma"))) void dot4_avx2(const float* x, const float* const* w, int K, float* out) {
  __m256 lo[kRows], hi[kRows];
  for (int r = 0; r < kRows; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
  int k = 0;
  for (; k + kLanes <= K; k += kLanes) {
    const __m256 x0 = _mm256_loadu_ps(x + k), x1 = _mm256_loadu_ps(x + k + 8);
    for (int r = 0; r < kRows; ++r) {
      lo[r] = _mm256_fmadd_ps(x0, _mm256_loadu_ps(w[r] + k), lo[r]);
      hi[r] = _mm256_fmadd_ps(x1, _mm256_loadu_ps(w[r] + k + 8), hi[r]);
    }
  }
  for (int r = 0; r < kRows; ++r) {
    alignas(32) float acc[kLanes];
    _mm256_store_ps(acc, lo[r]);
    _mm256_store_ps(acc + 8, hi[r]);
    out[r] = finish(acc, x, w[r], k, K);
  }
}
#endif

Dot4 pick_dot4() {
#ifdef DSPARK_X86
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return dot4_avx2;
#endif
  return dot4_portable;
}

template <typename T>
void to_float_portable(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// float16 and bfloat16 widen to float exactly, so a vector conversion gives the same floats.
#ifdef DSPARK_X86
__attribute__((target("avx2,f16c"))) void f16_to_float_f16c(const void* src, float* dst, int64_t n) {
  const auto* h = static_cast<const uint16_t*>(src);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i))));
  for (; i < n; ++i) dst[i] = _cvtsh_ss(h[i]);
}

__attribute__((target("avx2"))) void bf16_to_float_avx2(const void* src, float* dst, int64_t n) {
  const auto* h = static_cast<const uint16_t*>(src);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i)));
    _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16)));
  }
  for (; i < n; ++i) {
    const uint32_t bits = static_cast<uint32_t>(h[i]) << 16;
    std::memcpy(dst + i, &bits, sizeof(float));
  }
}
#endif

template <typename T>
void to_float(const T* src, float* dst, int64_t n) {
  static_assert(sizeof(T) == 2 || std::is_same_v<T, float>);
#ifdef DSPARK_X86
  if constexpr (std::is_same_v<T, mx::float16_t>) {
    static const bool f16c = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
    if (f16c) return f16_to_float_f16c(src, dst, n);
  } else if constexpr (std::is_same_v<T, mx::bfloat16_t>) {
    static const bool avx2 = __builtin_cpu_supports("avx2");
    if (avx2) return bf16_to_float_avx2(src, dst, n);
  }
#endif
  to_float_portable(src, dst, n);
}

// x as float once (a no-op view for float32).
template <typename T>
const float* x_as_float(const T* x, int64_t n, std::vector<float>& buf) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    buf.resize(static_cast<size_t>(n));
    to_float(x, buf.data(), n);
    return buf.data();
  }
}

// The weight rows n0 .. n0 + rows - 1 as float pointers (past N: the last row again, never
// stored); other dtypes are converted into buf (rows x K).
template <typename T>
void weight_rows(const T* w, int n0, int rows, int N, int K, std::vector<float>& buf, const float** out) {
  for (int r = 0; r < rows; ++r) {
    const int n = std::min(n0 + r, N - 1);
    if constexpr (std::is_same_v<T, float>) {
      out[r] = w + static_cast<int64_t>(n) * K;
    } else {
      to_float(w + static_cast<int64_t>(n) * K, buf.data() + static_cast<size_t>(r) * K, K);
      out[r] = buf.data() + static_cast<size_t>(r) * K;
    }
  }
}

// Runs fn(p) for the passes p = 0 .. passes - 1, split into contiguous runs over the pool.
template <typename Fn>
void over_passes(int passes, const Fn& fn) {
  cpu::Pool& pool = cpu::Pool::get();
  const int tasks = std::min(passes, pool.size() * 8);
  pool.run(tasks, [&](int t) {
    const int p0 = static_cast<int>(static_cast<int64_t>(passes) * t / tasks);
    const int p1 = static_cast<int>(static_cast<int64_t>(passes) * (t + 1) / tasks);
    fn(p0, p1);
  });
}

constexpr int kPrefetchPasses = 4;

inline void prefetch_l2(const char* p) {
#if defined(__GNUC__) || defined(__clang__)
  __builtin_prefetch(p, 0, 2);
#endif
}

template <typename T>
void linear_tiled(const T* x, const T* w, const T* bias, T* y, int M, int N, int K) {
  const il::Tiles& tiles = il::tiles();
  const int R = tiles.rows, C = tiles.cols;
  std::vector<float> xbuf;
  const float* xf = x_as_float(x, static_cast<int64_t>(M) * K, xbuf);
  over_passes((N + C - 1) / C, [&](int p0, int p1) {
    std::vector<float> wbuf;
    if constexpr (!std::is_same_v<T, float>) wbuf.resize(static_cast<size_t>(C) * K);
    const float* rows[il::kMaxCols];
    float out[il::kMaxRows * il::kMaxCols];
    for (int p = p0; p < p1; ++p) {
      const int n0 = p * C, cols = std::min(C, N - n0);
      weight_rows(w, n0, C, N, K, wbuf, rows);
      // The weight rows kPrefetchPasses passes ahead towards L2, spread over this pass's tiles
      // (issued at once they overrun the miss buffers and the memory does not overlap the FMAs).
      const int ahead_n = std::min(N, n0 + kPrefetchPasses * C), ahead_rows = std::min(C, N - ahead_n);
      const char* ahead = reinterpret_cast<const char*>(w + static_cast<int64_t>(ahead_n) * K);
      const int64_t lines = static_cast<int64_t>(ahead_rows) * K * static_cast<int64_t>(sizeof(T)) / 64;
      const int tile_count = (M + R - 1) / R;
      for (int m0 = 0, t = 0; m0 < M; m0 += R, ++t) {
        for (int64_t l = lines * t / tile_count; l < lines * (t + 1) / tile_count; ++l) prefetch_l2(ahead + l * 64);
        const int r = std::min(R, M - m0);
        (r == R ? tiles.full : tiles.row_tail[r - 1])(xf + static_cast<int64_t>(m0) * K, K, rows, K, out);
        for (int i = 0; i < r; ++i) {
          T* yrow = y + static_cast<int64_t>(m0 + i) * N + n0;
          for (int c = 0; c < cols; ++c) {
            float v = out[i * C + c];
            if (bias) v += static_cast<float>(bias[n0 + c]);
            yrow[c] = static_cast<T>(v);
          }
        }
      }
    }
  });
}

template <typename T>
void linear_rows(const T* x, const T* w, const T* bias, T* y, int M, int N, int K) {
  static const Dot4 dot4 = pick_dot4();
  std::vector<float> xbuf;
  const float* xf = x_as_float(x, static_cast<int64_t>(M) * K, xbuf);
  over_passes((N + kRows - 1) / kRows, [&](int p0, int p1) {
    std::vector<float> wbuf;
    if constexpr (!std::is_same_v<T, float>) wbuf.resize(static_cast<size_t>(kRows) * K);
    const float* rows[kRows];
    for (int p = p0; p < p1; ++p) {
      weight_rows(w, p * kRows, kRows, N, K, wbuf, rows);
      for (int m = 0; m < M; ++m) {
        float out[kRows];
        dot4(xf + static_cast<int64_t>(m) * K, rows, K, out);
        for (int r = 0; r < kRows && p * kRows + r < N; ++r) {
          const int n = p * kRows + r;
          float v = out[r];
          if (bias) v += static_cast<float>(bias[n]);
          y[static_cast<int64_t>(m) * N + n] = static_cast<T>(v);
        }
      }
    }
  });
}

template <typename T>
void linear_cpu(int kernel, const void* x, const void* w, const void* bias, void* y, int M, int N, int K) {
  auto f = kernel == kKernelRows ? linear_rows<T> : linear_tiled<T>;
  f(static_cast<const T*>(x), static_cast<const T*>(w), static_cast<const T*>(bias), static_cast<T*>(y), M, N, K);
}

}  // namespace

const char* invariant_linear_isa() { return il::tiles().name; }

mx::array invariant_linear(const mx::array& x, const mx::array& weight, const std::optional<mx::array>& bias,
                           const std::string& kernel, mx::StreamOrDevice s) {
  auto fail = [](const std::string& what) { throw std::invalid_argument("[dspark.invariant_linear] " + what); };
  if (kernel != "tiled" && kernel != "rows") fail("kernel must be 'tiled' or 'rows', not '" + kernel + "'");
  if (x.ndim() < 2 || weight.ndim() != 2) fail("x must be [..., M, K] and weight [N, K]");
  const int K = x.shape(-1), N = weight.shape(0);
  if (weight.shape(1) != K) {
    std::ostringstream msg;
    msg << "x has K = " << K << " but weight is [" << N << ", " << weight.shape(1) << "]";
    fail(msg.str());
  }
  const auto dt = x.dtype();
  if (dt != mx::float32 && dt != mx::float16 && dt != mx::bfloat16) fail("x must be float32, float16 or bfloat16");
  if (weight.dtype() != dt) fail("weight must have x's dtype");
  if (bias && (bias->ndim() != 1 || bias->shape(0) != N)) fail("bias must be [N]");
  auto st = mx::to_stream(s);
  if (st.device != mx::Device::cpu) fail("runs on the CPU (GPUs use kernels/invariant_linear.py's GPU instance)");
  // x as it comes (eval reads a strided one through cpu::RowOrder); weight and bias as they are
  // where already evaluated and contiguous: no graph node beyond the product's own.
  std::vector<mx::array> inputs = {x, cpu::as_contiguous(weight, st)};
  if (bias) inputs.push_back(cpu::as_contiguous(bias->dtype() == dt ? *bias : mx::astype(*bias, dt, st), st));
  auto shape = x.shape();
  shape.back() = N;
  return mx::array(std::move(shape), dt,
                   std::make_shared<InvariantLinear>(st, bias.has_value(), kernel == "rows" ? kKernelRows : kKernelTiled),
                   inputs);
}

void InvariantLinear::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  const auto& x = inputs[0];
  const auto& w = inputs[1];
  auto& y = outputs[0];
  y.set_data(mx::allocator::malloc(y.nbytes()));
  auto& enc = mx::cpu::get_command_encoder(stream());
  for (const auto& a : inputs) enc.set_input_array(a);
  enc.set_output_array(y);
  const int K = x.shape(-1), N = w.shape(0), M = static_cast<int>(x.size() / K);
  const void* b = has_bias_ ? inputs[2].data<void>() : nullptr;
  enc.dispatch([xr = cpu::RowOrder(x), wp = w.data<void>(), b, yp = y.data<void>(), dt = x.dtype(), M, N, K,
                kernel = kernel_]() {
    std::vector<char> xbuf;
    const void* xp = xr.get(xbuf);
    if (dt == mx::float32) {
      linear_cpu<float>(kernel, xp, wp, b, yp, M, N, K);
    } else if (dt == mx::float16) {
      linear_cpu<mx::float16_t>(kernel, xp, wp, b, yp, M, N, K);
    } else {
      linear_cpu<mx::bfloat16_t>(kernel, xp, wp, b, yp, M, N, K);
    }
  });
}

void InvariantLinear::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error(
      "[dspark.invariant_linear] the C++ primitive runs on the CPU; GPUs use the GPU instance "
      "(mlx_dspark.kernels.invariant_linear)");
}

}  // namespace dspark
