// ds_portable.h: the portability layer under every mlx-dspark GPU kernel body.
//
// A kernel body is written once, as templated device functions over the names below, and
// instantiated twice:
//   * Metal: by the metallib (metal/mlx_dspark.metal, used by the C++ primitives' eval_gpu) and by
//     mx.fast.metal_kernel (kernels/gpu_source.py); MLX prepends its Metal utils (bfloat16_t).
//   * CUDA:  by mx.fast.cuda_kernel (NVRTC); MLX prepends its CUDA device utils (__half,
//     __nv_bfloat16).
// What is mapped:
//   thread/threadgroup indices  the launcher passes tid / block ids in (ds_ctx); lane = tid & 31,
//                               warp = tid >> 5 (Apple SIMD-groups and NVIDIA warps are 32 wide
//                               and formed from consecutive thread indices of a 1-D group).
//   SIMD-group <-> warp         ds_shfl_xor / ds_shfl_down / ds_shfl_up / ds_shfl (32-bit values;
//                               64-bit ones go through two 32-bit halves, ds_shfl_xor64 ...).
//   threadgroup <-> shared      DS_SHARED_DECL on kernel-scope arrays, DS_SHARED on pointers.
//   global memory               DS_GLOBAL on pointers (Metal `device`; empty on CUDA), DS_THREAD
//                               on references to locals (Metal `thread`).
//   barriers                    DS_BARRIER() (threadgroup memory), DS_BARRIER_ALL() (also device).
//   types                       ds_i64 / ds_u32 / ds_u64, uint on CUDA, ds_to_float(x) and
//                               ds_from_float<T>(x) for float / half / bfloat16 on both.
//   vector loads                ds_load8(p, o): p[0..7] as float in 16-byte loads (Metal: packed
//                               types; CUDA: where ds_aligned16(p), else the caller loads scalars).
// Metal passes inputs of fewer than 8 elements in the `constant` address space, so body
// functions take their input pointers as template parameters (any address space binds).
#ifndef MLX_DSPARK_DS_PORTABLE_H
#define MLX_DSPARK_DS_PORTABLE_H

#if defined(__CUDACC__) || defined(__CUDACC_RTC__) || defined(__CUDA__)
#define DS_CUDA 1
#else
#define DS_METAL 1
#endif

#define DS_WARP 32
#define DS_FULL_MASK 0xffffffffu

#ifdef DS_METAL
// ------------------------------------------------------------------------------- Metal
#define DS_FUNC inline
#define DS_GLOBAL device
#define DS_SHARED threadgroup
#define DS_SHARED_DECL threadgroup
#define DS_THREAD thread
#define DS_BARRIER() threadgroup_barrier(mem_flags::mem_threadgroup)
#define DS_BARRIER_ALL() threadgroup_barrier(mem_flags::mem_device | mem_flags::mem_threadgroup)
typedef long ds_i64;
typedef uint ds_u32;
typedef ulong ds_u64;

DS_FUNC ds_u32 ds_shfl_xor(ds_u32 v, ds_u32 m) { return simd_shuffle_xor(v, (ushort)m); }
DS_FUNC ds_u32 ds_shfl_down(ds_u32 v, ds_u32 d) { return simd_shuffle_down(v, (ushort)d); }
DS_FUNC ds_u32 ds_shfl_up(ds_u32 v, ds_u32 d) { return simd_shuffle_up(v, (ushort)d); }
DS_FUNC ds_u32 ds_shfl(ds_u32 v, ds_u32 lane) { return simd_shuffle(v, (ushort)lane); }
DS_FUNC ds_u32 ds_f2u(float x) { return as_type<ds_u32>(x); }
DS_FUNC float ds_u2f(ds_u32 x) { return as_type<float>(x); }
template <typename T>
DS_FUNC float ds_to_float(T x) { return static_cast<float>(x); }
template <typename T>
DS_FUNC T ds_from_float(float x) { return static_cast<T>(x); }
DS_FUNC float ds_fma(float a, float b, float c) { return metal::fma(a, b, c); }
// Eight consecutive elements p[0..7] as float, exactly what ds_to_float gives element by element,
// in two packed vector loads (packed types need only the element's alignment: always allowed here).
DS_FUNC bool ds_aligned16(const DS_GLOBAL void*) { return true; }
DS_FUNC void ds_load8(const DS_GLOBAL float* p, DS_THREAD float* o) {
  const packed_float4 a = ((const DS_GLOBAL packed_float4*)p)[0], b = ((const DS_GLOBAL packed_float4*)p)[1];
  for (int e = 0; e < 4; ++e) { o[e] = a[e]; o[4 + e] = b[e]; }
}
DS_FUNC void ds_load8(const DS_GLOBAL half* p, DS_THREAD float* o) {
  const packed_half4 a = ((const DS_GLOBAL packed_half4*)p)[0], b = ((const DS_GLOBAL packed_half4*)p)[1];
  for (int e = 0; e < 4; ++e) { o[e] = static_cast<float>(a[e]); o[4 + e] = static_cast<float>(b[e]); }
}
DS_FUNC void ds_load8(const DS_GLOBAL bfloat16_t* p, DS_THREAD float* o) {  // bfloat16 -> float: the bits << 16
  const packed_ushort4 a = ((const DS_GLOBAL packed_ushort4*)p)[0], b = ((const DS_GLOBAL packed_ushort4*)p)[1];
  for (int e = 0; e < 4; ++e) {
    o[e] = as_type<float>((uint)a[e] << 16);
    o[4 + e] = as_type<float>((uint)b[e] << 16);
  }
}

#else
// -------------------------------------------------------------------------------- CUDA
#define DS_FUNC __device__ __forceinline__
#define DS_GLOBAL
#define DS_SHARED
#define DS_SHARED_DECL __shared__
#define DS_THREAD
#define DS_BARRIER() __syncthreads()
#define DS_BARRIER_ALL() __syncthreads()
typedef unsigned int uint;
typedef long long ds_i64;
typedef unsigned int ds_u32;
typedef unsigned long long ds_u64;

DS_FUNC ds_u32 ds_shfl_xor(ds_u32 v, ds_u32 m) { return __shfl_xor_sync(DS_FULL_MASK, v, (int)m); }
DS_FUNC ds_u32 ds_shfl_down(ds_u32 v, ds_u32 d) { return __shfl_down_sync(DS_FULL_MASK, v, d); }
DS_FUNC ds_u32 ds_shfl_up(ds_u32 v, ds_u32 d) { return __shfl_up_sync(DS_FULL_MASK, v, d); }
DS_FUNC ds_u32 ds_shfl(ds_u32 v, ds_u32 lane) { return __shfl_sync(DS_FULL_MASK, v, (int)lane); }
DS_FUNC ds_u32 ds_f2u(float x) { return __float_as_uint(x); }
DS_FUNC float ds_u2f(ds_u32 x) { return __uint_as_float(x); }
DS_FUNC float ds_to_float(float x) { return x; }
DS_FUNC float ds_to_float(__half x) { return __half2float(x); }
DS_FUNC float ds_to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
// Round a float to the output type T (float, __half or __nv_bfloat16): round to nearest even.
template <typename T>
DS_FUNC T ds_from_float(float x);
template <>
DS_FUNC float ds_from_float<float>(float x) { return x; }
template <>
DS_FUNC __half ds_from_float<__half>(float x) { return __float2half(x); }
template <>
DS_FUNC __nv_bfloat16 ds_from_float<__nv_bfloat16>(float x) { return __float2bfloat16(x); }
DS_FUNC float ds_fma(float a, float b, float c) { return __fmaf_rn(a, b, c); }
// Eight consecutive elements p[0..7] as float, exactly what ds_to_float gives element by element,
// in 16-byte vector loads: only where ds_aligned16(p) (32 bytes in all for float: two loads).
DS_FUNC bool ds_aligned16(const void* p) { return ((unsigned long long)p & 15ull) == 0ull; }
DS_FUNC void ds_load8(const float* p, float* o) {
  const float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
  o[0] = a.x; o[1] = a.y; o[2] = a.z; o[3] = a.w; o[4] = b.x; o[5] = b.y; o[6] = b.z; o[7] = b.w;
}
DS_FUNC void ds_load8_words(const void* p, ds_u32* w) {
  const uint4 v = *reinterpret_cast<const uint4*>(p);
  w[0] = v.x; w[1] = v.y; w[2] = v.z; w[3] = v.w;
}
DS_FUNC void ds_load8(const __half* p, float* o) {  // element 2i: the low half of word i
  ds_u32 w[4];
  ds_load8_words(p, w);
  for (int i = 0; i < 4; ++i) {
    o[2 * i] = __half2float(__ushort_as_half((unsigned short)(w[i] & 0xffffu)));
    o[2 * i + 1] = __half2float(__ushort_as_half((unsigned short)(w[i] >> 16)));
  }
}
DS_FUNC void ds_load8(const __nv_bfloat16* p, float* o) {  // bfloat16 -> float: the bits << 16
  ds_u32 w[4];
  ds_load8_words(p, w);
  for (int i = 0; i < 4; ++i) {
    o[2 * i] = __uint_as_float(w[i] << 16);
    o[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}
#endif

// ------------------------------------------------------------------------ both languages
struct ds_ctx {
  uint tid;       // thread index in the (1-D) threadgroup / block
  uint nthreads;  // threads per threadgroup / block (a multiple of 32)
  uint bx;        // threadgroup / block index, x
  uint by;        // threadgroup / block index, y
};

DS_FUNC uint ds_lane(ds_ctx c) { return c.tid & (DS_WARP - 1); }
DS_FUNC uint ds_warp(ds_ctx c) { return c.tid / DS_WARP; }

DS_FUNC bool ds_isnan(float x) { return (ds_f2u(x) & 0x7fffffffu) > 0x7f800000u; }

DS_FUNC ds_i64 ds_make_i64(ds_u32 hi, ds_u32 lo) { return (ds_i64)(((ds_u64)hi << 32) | (ds_u64)lo); }
DS_FUNC ds_i64 ds_shfl_xor64(ds_i64 v, uint m) {
  ds_u64 u = (ds_u64)v;
  return ds_make_i64(ds_shfl_xor((ds_u32)(u >> 32), m), ds_shfl_xor((ds_u32)u, m));
}
DS_FUNC ds_i64 ds_shfl_up64(ds_i64 v, uint d) {
  ds_u64 u = (ds_u64)v;
  return ds_make_i64(ds_shfl_up((ds_u32)(u >> 32), d), ds_shfl_up((ds_u32)u, d));
}
DS_FUNC ds_i64 ds_shfl64(ds_i64 v, uint lane) {
  ds_u64 u = (ds_u64)v;
  return ds_make_i64(ds_shfl((ds_u32)(u >> 32), lane), ds_shfl((ds_u32)u, lane));
}
DS_FUNC int ds_shfl_xor_i32(int v, uint m) { return (int)ds_shfl_xor((ds_u32)v, m); }
DS_FUNC float ds_shfl_xor_f32(float v, uint m) { return ds_u2f(ds_shfl_xor(ds_f2u(v), m)); }

// Sum of v over the 32 lanes; every lane gets it.
DS_FUNC ds_i64 ds_warp_sum64(ds_i64 v) {
  for (uint m = DS_WARP / 2; m > 0; m >>= 1) v += ds_shfl_xor64(v, m);
  return v;
}
// Inclusive prefix sum of v over the lanes (lane 0 .. this lane).
DS_FUNC ds_i64 ds_warp_incl_scan64(ds_i64 v, uint lane) {
  for (uint d = 1; d < DS_WARP; d <<= 1) {
    ds_i64 o = ds_shfl_up64(v, d);
    if (lane >= d) v += o;
  }
  return v;
}
// Minimum over the 32 lanes; every lane gets it.
DS_FUNC int ds_warp_min_i32(int v) {
  for (uint m = DS_WARP / 2; m > 0; m >>= 1) {
    int o = ds_shfl_xor_i32(v, m);
    v = o < v ? o : v;
  }
  return v;
}

// argmax order, as mx.argmax: NaN beats every number, a larger value beats a smaller one,
// and between equals (or two NaNs) the smaller index wins.
DS_FUNC bool ds_argmax_better(float a, int ia, float b, int ib) {
  bool an = ds_isnan(a), bn = ds_isnan(b);
  if (an || bn) return an && (!bn || ia < ib);
  return a > b || (a == b && ia < ib);
}
// Warp argmax: every lane ends with the warp's best (value, index).
DS_FUNC void ds_warp_argmax(DS_THREAD float& v, DS_THREAD int& i) {
  for (uint m = DS_WARP / 2; m > 0; m >>= 1) {
    float ov = ds_shfl_xor_f32(v, m);
    int oi = ds_shfl_xor_i32(i, m);
    if (ds_argmax_better(ov, oi, v, i)) { v = ov; i = oi; }
  }
}
// Block argmax of (v, i) held one per thread; the result is in sv[0], si[0] after the call.
// sv / si: shared scratch of 32 entries. All threads must call it.
DS_FUNC void ds_block_argmax(ds_ctx c, float v, int i, DS_SHARED float* sv, DS_SHARED int* si) {
  ds_warp_argmax(v, i);
  uint nw = c.nthreads / DS_WARP;
  if (ds_lane(c) == 0) { sv[ds_warp(c)] = v; si[ds_warp(c)] = i; }
  DS_BARRIER();
  if (ds_warp(c) == 0) {
    uint l = ds_lane(c);
    v = l < nw ? sv[l] : sv[0];
    i = l < nw ? si[l] : si[0];
    ds_warp_argmax(v, i);
    if (l == 0) { sv[0] = v; si[0] = i; }
  }
  DS_BARRIER();
}

#endif  // MLX_DSPARK_DS_PORTABLE_H
