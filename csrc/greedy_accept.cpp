// Greedy verify-and-accept: the op and its CPU evaluation.
#include <cstdint>
#include <cstring>
#include <limits>
#include <sstream>
#include <stdexcept>

#include "dspark.h"
#include "mlx/backend/cpu/encoder.h"

namespace dspark {

namespace {

// Order-preserving integer keys of IEEE values: sign-magnitude bits -> two's complement, with
// -0 and +0 equal (as float comparison has them). NaNs land beyond +-inf's key.
inline int32_t key(uint32_t b) {
  int32_t m = static_cast<int32_t>(b & 0x7fffffffu);
  int32_t s = static_cast<int32_t>(b) >> 31;
  return (m ^ s) - s;
}
inline int16_t key(uint16_t b) {
  int16_t m = static_cast<int16_t>(b & 0x7fffu);
  int16_t s = static_cast<int16_t>(static_cast<int16_t>(b) >> 15);
  return static_cast<int16_t>((m ^ s) - s);
}

// U: raw bits type, K: key type; inf_key: the key of +inf (|key| > inf_key <=> NaN).
template <typename U, typename K>
int32_t argmax_bits(const U* x, int64_t V, K inf_key) {
  constexpr int64_t kBlock = 512;
  K best = std::numeric_limits<K>::min();
  int64_t best_start = 0;
  for (int64_t s = 0; s < V; s += kBlock) {
    const int64_t n = std::min(kBlock, V - s);
    K hi = std::numeric_limits<K>::min();
    K lo = std::numeric_limits<K>::max();
    for (int64_t k = 0; k < n; ++k) {  // vectorizes: integer max / min
      K v = key(x[s + k]);
      hi = v > hi ? v : hi;
      lo = v < lo ? v : lo;
    }
    if (hi > inf_key || lo < static_cast<K>(-inf_key)) {  // a NaN: the first one wins
      for (int64_t k = 0; k < n; ++k) {
        K v = key(x[s + k]);
        if (v > inf_key || v < static_cast<K>(-inf_key)) return static_cast<int32_t>(s + k);
      }
    }
    if (hi > best) {  // strict: the first block holding the maximum is kept
      best = hi;
      best_start = s;
    }
  }
  for (int64_t k = best_start;; ++k) {
    if (key(x[k]) == best) return static_cast<int32_t>(k);
  }
}

}  // namespace

int32_t argmax_row(const void* row, mx::Dtype dtype, int64_t V) {
  if (dtype == mx::float32) {
    return argmax_bits(static_cast<const uint32_t*>(row), V, static_cast<int32_t>(0x7f800000));
  } else if (dtype == mx::float16) {
    return argmax_bits(static_cast<const uint16_t*>(row), V, static_cast<int16_t>(0x7c00));
  } else if (dtype == mx::bfloat16) {
    return argmax_bits(static_cast<const uint16_t*>(row), V, static_cast<int16_t>(0x7f80));
  }
  throw std::invalid_argument("[dspark] argmax_row: logits must be float32, float16 or bfloat16");
}

std::vector<mx::array> greedy_accept(const mx::array& logits, const mx::array& draft,
                                     mx::StreamOrDevice s) {
  if (logits.ndim() != 3) {
    throw std::invalid_argument("[dspark.greedy_accept] logits must be [B, w, V]");
  }
  const int B = logits.shape(0), w = logits.shape(1), V = logits.shape(2);
  if (w < 1 || V < 1) {
    throw std::invalid_argument("[dspark.greedy_accept] logits need w >= 1 and V >= 1");
  }
  if (draft.ndim() != 2 || draft.shape(0) != B || draft.shape(1) != w - 1) {
    std::ostringstream msg;
    msg << "[dspark.greedy_accept] draft must be [B, w-1] = [" << B << ", " << w - 1 << "]";
    throw std::invalid_argument(msg.str());
  }
  auto dt = logits.dtype();
  if (dt != mx::float32 && dt != mx::float16 && dt != mx::bfloat16) {
    throw std::invalid_argument("[dspark.greedy_accept] logits must be float32, float16 or bfloat16");
  }
  auto st = mx::to_stream(s);
  if (st.device == mx::Device::gpu && w > kGaMaxW) {
    throw std::invalid_argument("[dspark.greedy_accept] the GPU kernel takes w <= 128");
  }
  auto lg = mx::contiguous(logits, false, st);
  // A w = 1 block has no draft: a one-element placeholder keeps every input non-empty.
  auto d = w > 1 ? mx::contiguous(mx::astype(draft, mx::int32, st), false, st)
                 : mx::zeros({B, 1}, mx::int32, st);
  return mx::array::make_arrays({{B, w}, {B}, {B}}, {mx::int32, mx::int32, mx::int32},
                                std::make_shared<GreedyAccept>(st), {lg, d});
}

void GreedyAccept::eval_cpu(const std::vector<mx::array>& inputs,
                            std::vector<mx::array>& outputs) {
  const auto& lg = inputs[0];
  const auto& d = inputs[1];
  for (auto& o : outputs) o.set_data(mx::allocator::malloc(o.nbytes()));
  auto& enc = mx::cpu::get_command_encoder(stream());
  enc.set_input_array(lg);
  enc.set_input_array(d);
  for (auto& o : outputs) enc.set_output_array(o);
  const int B = lg.shape(0), w = lg.shape(1);
  const int64_t V = lg.shape(2);
  enc.dispatch([row0 = static_cast<const char*>(lg.data<void>()), dtype = lg.dtype(),
                item = lg.itemsize(), dr = d.data<int32_t>(), tgt = outputs[0].data<int32_t>(),
                acc = outputs[1].data<int32_t>(), bon = outputs[2].data<int32_t>(), B, w, V]() {
    for (int b = 0; b < B; ++b) {
      int32_t* t = tgt + static_cast<int64_t>(b) * w;
      for (int j = 0; j < w; ++j) {
        const char* row = row0 + (static_cast<int64_t>(b) * w + j) * V * item;
        t[j] = argmax_row(row, dtype, V);
      }
      int a = 0;
      while (a < w - 1 && dr[static_cast<int64_t>(b) * (w - 1) + a] == t[a]) a++;
      acc[b] = a;
      bon[b] = t[a];
    }
  });
}

}  // namespace dspark
