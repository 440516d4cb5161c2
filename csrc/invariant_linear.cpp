// Width-invariant dense linear, y = x W^T (+ bias): the op and its CPU evaluation.
// Semantics: python/mlx_dspark/kernels/invariant_linear.py::invariant_linear_reference.
//
// Every output y[m, n] is one call of the same fixed-order dot product of x row m with weight
// row n (16 float lanes over k in steps of 16, in order; the lanes added by a fixed tree; then the
// k tail in order; then the bias), so row m of an M-row call is bit-identical to the row alone.
// What is blocked is the weight: four weight rows per pass, each read from memory once for all M
// rows (small-M products are memory-bound), the passes split over a few threads. The row count
// never changes which code computes a row. On x86-64 the dot product is AVX2 + FMA where the CPU
// has both (chosen once per process), the portable loop otherwise.
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define DSPARK_X86 1
#endif

#include "dspark.h"
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

// A few worker threads for the weight passes; the calling thread works too.
class Pool {
 public:
  static Pool& get() {
    static Pool* pool = new Pool();  // never destroyed: workers may outlive static destructors
    return *pool;
  }
  int size() const { return static_cast<int>(workers_.size()) + 1; }

  void run(int tasks, const std::function<void(int)>& fn) {
    if (tasks <= 1 || workers_.empty()) {
      for (int i = 0; i < tasks; ++i) fn(i);
      return;
    }
    std::unique_lock<std::mutex> call(call_mu_);  // one job at a time
    {
      std::lock_guard<std::mutex> lk(mu_);
      fn_ = &fn;
      tasks_ = tasks;
      next_.store(0);
      busy_ = static_cast<int>(workers_.size());
      ++generation_;
    }
    cv_.notify_all();
    work();
    std::unique_lock<std::mutex> lk(mu_);
    done_cv_.wait(lk, [&] { return busy_ == 0; });
    fn_ = nullptr;
  }

 private:
  Pool() {
    int n = static_cast<int>(std::thread::hardware_concurrency());
    if (const char* env = std::getenv("MLX_DSPARK_CPU_THREADS")) n = std::atoi(env);
    n = std::max(1, std::min(n, 16));
    for (int i = 1; i < n; ++i) workers_.emplace_back([this] { loop(); });
    for (auto& t : workers_) t.detach();
  }
  void work() {
    for (int i = next_.fetch_add(1); i < tasks_; i = next_.fetch_add(1)) (*fn_)(i);
  }
  void loop() {
    uint64_t seen = 0;
    for (;;) {
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return generation_ != seen; });
        seen = generation_;
      }
      work();
      std::lock_guard<std::mutex> lk(mu_);
      if (--busy_ == 0) done_cv_.notify_one();
    }
  }

  std::vector<std::thread> workers_;
  std::mutex call_mu_, mu_;
  std::condition_variable cv_, done_cv_;
  const std::function<void(int)>* fn_ = nullptr;
  int tasks_ = 0;
  int busy_ = 0;
  uint64_t generation_ = 0;
  std::atomic<int> next_{0};
};

template <typename T>
void to_float(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <typename T>
void linear_cpu(const T* x, const T* w, const T* bias, T* y, int M, int N, int K) {
  static const Dot4 dot4 = pick_dot4();
  // x as float once (a no-op view for float32)
  std::vector<float> xbuf;
  const float* xf;
  if constexpr (std::is_same_v<T, float>) {
    xf = x;
  } else {
    xbuf.resize(static_cast<size_t>(M) * K);
    to_float(x, xbuf.data(), static_cast<int64_t>(M) * K);
    xf = xbuf.data();
  }
  const int passes = (N + kRows - 1) / kRows;
  Pool& pool = Pool::get();
  const int tasks = std::min(passes, pool.size() * 8);
  pool.run(tasks, [&](int t) {
    const int p0 = static_cast<int>(static_cast<int64_t>(passes) * t / tasks);
    const int p1 = static_cast<int>(static_cast<int64_t>(passes) * (t + 1) / tasks);
    std::vector<float> wbuf;
    if constexpr (!std::is_same_v<T, float>) wbuf.resize(static_cast<size_t>(kRows) * K);
    for (int p = p0; p < p1; ++p) {
      const float* rows[kRows];
      for (int r = 0; r < kRows; ++r) {
        const int n = std::min(p * kRows + r, N - 1);  // past N: a repeat of the last row, not stored
        if constexpr (std::is_same_v<T, float>) {
          rows[r] = w + static_cast<int64_t>(n) * K;
        } else {
          to_float(w + static_cast<int64_t>(n) * K, wbuf.data() + static_cast<size_t>(r) * K, K);
          rows[r] = wbuf.data() + static_cast<size_t>(r) * K;
        }
      }
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

}  // namespace

mx::array invariant_linear(const mx::array& x, const mx::array& weight, const std::optional<mx::array>& bias,
                           mx::StreamOrDevice s) {
  auto fail = [](const std::string& what) { throw std::invalid_argument("[dspark.invariant_linear] " + what); };
  if (x.ndim() != 2 || weight.ndim() != 2) fail("x must be [M, K] and weight [N, K]");
  const int M = x.shape(0), K = x.shape(1), N = weight.shape(0);
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
  std::vector<mx::array> inputs = {mx::contiguous(x, false, st), mx::contiguous(weight, false, st)};
  if (bias) inputs.push_back(mx::contiguous(mx::astype(*bias, dt, st), false, st));
  return mx::array({M, N}, dt, std::make_shared<InvariantLinear>(st, bias.has_value()), inputs);
}

void InvariantLinear::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  const auto& x = inputs[0];
  const auto& w = inputs[1];
  auto& y = outputs[0];
  y.set_data(mx::allocator::malloc(y.nbytes()));
  auto& enc = mx::cpu::get_command_encoder(stream());
  for (const auto& a : inputs) enc.set_input_array(a);
  enc.set_output_array(y);
  const int M = x.shape(0), K = x.shape(1), N = w.shape(0);
  const void* b = has_bias_ ? inputs[2].data<void>() : nullptr;
  enc.dispatch([xp = x.data<void>(), wp = w.data<void>(), b, yp = y.data<void>(), dt = x.dtype(), M, N, K]() {
    if (dt == mx::float32) {
      linear_cpu(static_cast<const float*>(xp), static_cast<const float*>(wp), static_cast<const float*>(b),
                 static_cast<float*>(yp), M, N, K);
    } else if (dt == mx::float16) {
      using H = mx::float16_t;
      linear_cpu(static_cast<const H*>(xp), static_cast<const H*>(wp), static_cast<const H*>(b), static_cast<H*>(yp),
                 M, N, K);
    } else {
      using H = mx::bfloat16_t;
      linear_cpu(static_cast<const H*>(xp), static_cast<const H*>(wp), static_cast<const H*>(b), static_cast<H*>(yp),
                 M, N, K);
    }
  });
}

void InvariantLinear::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error(
      "[dspark.invariant_linear] the C++ primitive runs on the CPU; GPUs use the GPU instance "
      "(mlx_dspark.kernels.invariant_linear)");
}

}  // namespace dspark
