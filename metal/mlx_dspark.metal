// mlx_dspark.metallib: the Metal instance of every kernel body, dispatched by the C++
// primitives' eval_gpu (csrc/eval_gpu.cpp). The bodies live in python/mlx_dspark/kernels/gpu/
// and are shared with the CUDA instance (mx.fast.cuda_kernel) and the mx.fast.metal_kernel one.
// Buffer indices here must match csrc/eval_gpu.cpp.
#ifndef DS_METAL_STUB
#include <metal_stdlib>
#include "mlx/backend/metal/kernels/bf16.h"
using namespace metal;
#endif

#include "ds_portable.h"
#include "greedy_accept.h"
#include "sampling_accept.h"

#define DS_GA_CHUNK 4096  // dspark::kGaChunk

template <typename T>
[[kernel]] void ds_ga_partial_kernel(const device T* logits [[buffer(0)]],
                              device int* part [[buffer(1)]],
                              constant int& V [[buffer(2)]],
                              constant int& R [[buffer(3)]],
                              uint3 tpos [[thread_position_in_threadgroup]],
                              uint3 tgpos [[threadgroup_position_in_grid]],
                              uint3 tpg [[threads_per_threadgroup]]) {
  ds_ctx c;
  c.tid = tpos.x;
  c.nthreads = tpg.x;
  c.bx = tgpos.x;
  c.by = tgpos.y;
  threadgroup float sv[32];
  threadgroup int si[32];
  const int nch = (V + DS_GA_CHUNK - 1) / DS_GA_CHUNK;
  ds_ga_partial(c, logits, V, DS_GA_CHUNK, nch, part, part + R * nch, sv, si);
}

[[kernel]] void ds_ga_finalize_kernel(const device int* part [[buffer(0)]],
                               const device int* draft [[buffer(1)]],
                               constant int* dims [[buffer(2)]],
                               device int* target [[buffer(3)]],
                               device int* accepted [[buffer(4)]],
                               device int* bonus [[buffer(5)]],
                               uint3 tpos [[thread_position_in_threadgroup]],
                               uint3 tgpos [[threadgroup_position_in_grid]],
                               uint3 tpg [[threads_per_threadgroup]]) {
  ds_ctx c;
  c.tid = tpos.x;
  c.nthreads = tpg.x;
  c.bx = tgpos.x;
  c.by = tgpos.y;
  threadgroup int s_tgt[DS_GA_MAX_W];
  const int w = dims[1];
  const int nch = dims[3];
  ds_ga_finalize(c, (int)c.bx, draft, w, nch, part, part + dims[0] * w * nch, target, accepted,
                 bonus, s_tgt);
}

template <bool HAS_Q>
[[kernel]] void ds_sa_kernel(const device float* p [[buffer(0)]],
                      const device float* q [[buffer(1)]],
                      const device int* draft [[buffer(2)]],
                      const device float* u [[buffer(3)]],
                      const device float* ub [[buffer(4)]],
                      constant int* dims [[buffer(5)]],
                      device int* accepted [[buffer(6)]],
                      device int* bonus [[buffer(7)]],
                      uint3 tpos [[thread_position_in_threadgroup]],
                      uint3 tgpos [[threadgroup_position_in_grid]],
                      uint3 tpg [[threads_per_threadgroup]]) {
  ds_ctx c;
  c.tid = tpos.x;
  c.nthreads = tpg.x;
  c.bx = tgpos.x;
  c.by = tgpos.y;
  threadgroup ds_i64 s64[36];
  threadgroup int s_i[4];
  threadgroup float sv[32];
  threadgroup int si[32];
  ds_sa_run<HAS_Q>(c, p, q, draft, u, ub, dims[0], dims[1], accepted, bonus, s64, s_i, sv, si);
}

#define DS_INSTANTIATE_GA(tname, T) \
  template [[host_name("ds_ga_partial_" #tname)]] [[kernel]] decltype(ds_ga_partial_kernel<T>) ds_ga_partial_kernel<T>;

DS_INSTANTIATE_GA(float32, float)
DS_INSTANTIATE_GA(float16, half)
DS_INSTANTIATE_GA(bfloat16, bfloat16_t)

template [[host_name("ds_sa_q")]] [[kernel]] decltype(ds_sa_kernel<true>) ds_sa_kernel<true>;
template [[host_name("ds_sa_onehot")]] [[kernel]] decltype(ds_sa_kernel<false>) ds_sa_kernel<false>;
