// eval_gpu of the primitives. On macOS (MLX built with Metal, _METAL_ defined) it dispatches the
// kernels of mlx_dspark.metallib, which sits next to this extension and is built from
// metal/mlx_dspark.metal: the same kernel bodies (python/mlx_dspark/kernels/gpu/*.h) that run
// through mx.fast.cuda_kernel on CUDA. Elsewhere the Python layer never sends these primitives
// to the GPU (it uses the CUDA instance or the reference), and eval_gpu says so.
#include <algorithm>
#include <stdexcept>
#include <string>

#include "dspark.h"

#ifdef _METAL_
#include <dlfcn.h>

#include <filesystem>

#include "mlx/backend/metal/device.h"
#include "mlx/backend/metal/utils.h"
#endif

namespace dspark {

#ifdef _METAL_

namespace {

// The metallib lives next to the extension module.
const std::string& binary_dir() {
  static std::string dir = []() {
    Dl_info info;
    if (!dladdr(reinterpret_cast<void*>(&binary_dir), &info)) {
      throw std::runtime_error("[dspark] cannot locate the extension binary");
    }
    return std::filesystem::path(info.dli_fname).parent_path().string();
  }();
  return dir;
}

MTL::Library* library(mx::metal::Device& d) { return d.get_library("mlx_dspark", binary_dir()); }

}  // namespace

void GreedyAccept::eval_gpu(const std::vector<mx::array>& inputs,
                            std::vector<mx::array>& outputs) {
  auto& s = stream();
  auto& d = mx::metal::device(s.device);
  const auto& lg = inputs[0];
  const auto& dr = inputs[1];
  const int B = lg.shape(0), w = lg.shape(1), V = lg.shape(2);
  const int R = B * w;
  const int nch = (V + kGaChunk - 1) / kGaChunk;
  for (auto& o : outputs) o.set_data(mx::allocator::malloc(o.nbytes()));
  mx::array part({2 * R * nch}, mx::int32, nullptr, {});
  part.set_data(mx::allocator::malloc(part.nbytes()));

  auto* lib = library(d);
  auto& enc = mx::metal::get_command_encoder(s);
  // Pass 1: the argmax of every chunk of every row.
  enc.set_compute_pipeline_state(d.get_kernel("ds_ga_partial_" + mx::type_to_name(lg), lib));
  enc.set_input_array(lg, 0);
  enc.set_output_array(part, 1);
  enc.set_bytes(V, 2);
  enc.set_bytes(R, 3);
  enc.dispatch_threadgroups(MTL::Size(nch, R, 1), MTL::Size(kGaThreads, 1, 1));
  // Pass 2: per batch element, the row argmaxes, the accepted prefix and the bonus.
  enc.set_compute_pipeline_state(d.get_kernel("ds_ga_finalize_kernel", lib));
  enc.set_input_array(part, 0);
  enc.set_input_array(dr, 1);
  const int dims[4] = {B, w, V, nch};
  enc.set_bytes(dims, 4, 2);
  enc.set_output_array(outputs[0], 3);
  enc.set_output_array(outputs[1], 4);
  enc.set_output_array(outputs[2], 5);
  enc.dispatch_threadgroups(MTL::Size(B, 1, 1), MTL::Size(kGaThreads, 1, 1));
  enc.add_temporary(part);
}

void SamplingAccept::eval_gpu(const std::vector<mx::array>& inputs,
                              std::vector<mx::array>& outputs) {
  auto& s = stream();
  auto& d = mx::metal::device(s.device);
  const auto& p = inputs[0];
  const int B = p.shape(0);
  const int dims[2] = {p.shape(1), p.shape(2)};
  for (auto& o : outputs) o.set_data(mx::allocator::malloc(o.nbytes()));
  auto& enc = mx::metal::get_command_encoder(s);
  auto* kernel = d.get_kernel(has_q() ? "ds_sa_q" : "ds_sa_onehot", library(d));
  // The body takes any multiple of 32 threads; a pipeline may allow fewer than 1024.
  const size_t max_threads = kernel->maxTotalThreadsPerThreadgroup();
  const size_t threads = std::max<size_t>(32, std::min<size_t>(kSaThreads, max_threads) / 32 * 32);
  enc.set_compute_pipeline_state(kernel);
  for (int i = 0; i < 5; ++i) enc.set_input_array(inputs[i], i);
  enc.set_bytes(dims, 2, 5);
  enc.set_output_array(outputs[0], 6);
  enc.set_output_array(outputs[1], 7);
  enc.dispatch_threadgroups(MTL::Size(B, 1, 1), MTL::Size(threads, 1, 1));
}

#else  // no Metal

void GreedyAccept::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error(
      "[dspark] GreedyAccept has no GPU path in this build (CUDA uses mx.fast.cuda_kernel)");
}

void SamplingAccept::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error(
      "[dspark] SamplingAccept has no GPU path in this build (CUDA uses mx.fast.cuda_kernel)");
}

#endif

}  // namespace dspark
