// metal_emu.h: the Metal branch of ds_portable.h on CPU threads, for the tests that run a GPU
// kernel body itself (tests/emulation/*_emu.cpp). Address spaces are empty, a threadgroup
// barrier is a std::barrier of the emulated threads, and a SIMD shuffle goes through a shared
// slot array behind that barrier (every shuffle in the bodies is called by all threads of the
// emulated group, which is what makes this exact). Each thread sets t_tid to its slot (its thread
// index in the group, or its lane when one warp is emulated at a time) and g_bar to its group's
// barrier; or the lanes of one warp run as fibers of one thread (warp_fibers.h sets g_sync: much
// cheaper than 32 threads on a loaded machine). Element types: half is _Float16, bfloat16_t rounds to
// nearest even as Metal's bfloat, and the packed vectors ds_load8 reads. Include this, then the
// body header, then undefine `thread`, `device`, `threadgroup`.
#pragma once
#include <barrier>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <thread>
#include <vector>
typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned long ulong;
#define device
#define threadgroup
#define thread
namespace metal {
enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2 };
inline mem_flags operator|(mem_flags a, mem_flags b) { return mem_flags(int(a) | int(b)); }
inline float exp(float x) { return std::exp(x); }
inline float fma(float a, float b, float c) { return std::fma(a, b, c); }
}  // namespace metal
using namespace metal;
static std::barrier<>* g_bar;
static void (*g_sync)() = nullptr;  // fibers (warp_fibers.h): every lane of the warp reaches this point
static thread_local uint t_tid;
static unsigned g_slots[1024];
inline void threadgroup_barrier(mem_flags) { g_bar->arrive_and_wait(); }
template <class T> T simd_shuffle_xor(T v, ushort m) {
  if (g_sync) {  // fibers run in lane order between two syncs: no third one needed
    g_slots[t_tid] = v;
    g_sync();
    T r = g_slots[t_tid ^ m];
    g_sync();
    return r;
  }
  g_bar->arrive_and_wait();
  g_slots[t_tid] = v;
  g_bar->arrive_and_wait();
  T r = g_slots[t_tid ^ m];
  g_bar->arrive_and_wait();
  return r;
}
template <class T> T simd_shuffle_down(T v, ushort) { return v; }  // unused by the bodies
template <class T> T simd_shuffle_up(T v, ushort) { return v; }
template <class T> T simd_shuffle(T v, ushort) { return v; }
template <class T, class U> T as_type(U x) { T t; std::memcpy(&t, &x, sizeof(T)); return t; }
typedef _Float16 half;
struct bfloat16_t {
  unsigned short bits;
  bfloat16_t() = default;
  bfloat16_t(float f) {  // round to nearest even; NaN stays NaN
    const uint u = as_type<uint>(f);
    bits = (u & 0x7fffffffu) > 0x7f800000u ? (unsigned short)((u >> 16) | 0x40u)
                                           : (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
  operator float() const { return as_type<float>((uint)bits << 16); }
};
template <class T, int N> struct packed_vec {
  T v[N];
  T operator[](int i) const { return v[i]; }
};
typedef packed_vec<float, 4> packed_float4;
typedef packed_vec<half, 4> packed_half4;
typedef packed_vec<ushort, 4> packed_ushort4;
#include "ds_portable.h"
