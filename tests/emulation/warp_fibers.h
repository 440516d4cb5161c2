// warp_fibers.h: the 32 lanes of one emulated warp as fibers (ucontext) of the calling thread, for
// bodies whose only cross-lane operations are SIMD shuffles (metal_emu.h's simd_shuffle_xor calls
// g_sync). A sync switches to the next lane in lane order; the lane after the last one resumes the
// first, so when a lane returns from a sync every lane has reached it (a barrier, without OS threads:
// one core, deterministic). A lane that syncs while another has returned (shuffles under divergent
// control flow, which the GPU bodies must not have) aborts the run. Include after metal_emu.h.
#pragma once
#include <ucontext.h>

#include <cstdlib>
#include <functional>

namespace warp_fibers {
constexpr int kLanes = 32;
constexpr size_t kStack = 256 << 10;
inline ucontext_t g_main, g_ctx[kLanes];
inline char* g_stacks[kLanes];
inline int g_cur;
inline bool g_done[kLanes];
inline const std::function<void(int)>* g_fn;

inline void fail(const char* what) {
  std::fprintf(stderr, "warp_fibers: %s\n", what);
  std::abort();
}

inline void sync() {
  const int me = g_cur, next = (me + 1) % kLanes;
  if (g_done[next]) fail("a lane synced after another returned (divergent shuffles)");
  g_cur = next;
  t_tid = next;
  swapcontext(&g_ctx[me], &g_ctx[next]);
}

inline void entry() {
  const int me = g_cur;
  (*g_fn)(me);
  g_done[me] = true;
  if (me == kLanes - 1) setcontext(&g_main);
  if (g_done[me + 1]) fail("lanes returned out of order");
  g_cur = me + 1;
  t_tid = me + 1;
  setcontext(&g_ctx[me + 1]);
}

// fn(lane) for lane = 0..31, as one warp (fn sets nothing of metal_emu.h: t_tid is the lane).
inline void run_warp(const std::function<void(int)>& fn) {
  g_fn = &fn;
  g_sync = sync;
  for (int l = 0; l < kLanes; ++l) {
    if (!g_stacks[l]) g_stacks[l] = static_cast<char*>(std::malloc(kStack));
    g_done[l] = false;
    getcontext(&g_ctx[l]);
    g_ctx[l].uc_stack.ss_sp = g_stacks[l];
    g_ctx[l].uc_stack.ss_size = kStack;
    g_ctx[l].uc_link = nullptr;
    makecontext(&g_ctx[l], entry, 0);
  }
  g_cur = 0;
  t_tid = 0;
  swapcontext(&g_main, &g_ctx[0]);
  for (int l = 0; l < kLanes; ++l)
    if (!g_done[l]) fail("a lane did not return");
  g_sync = nullptr;
}
}  // namespace warp_fibers
