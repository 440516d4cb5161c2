// gdn_replay.h: the Gated DeltaNet recurrence over T positions: a hybrid target's recurrent
// layer forward (outputs y and the new state) and, over recorded positions, the replay that rolls
// its state back to an accept point. One body over ds_portable.h.
// Semantics: kernels/gdn_replay.py::gdn_recurrence_reference (mlx-lm's scalar-gated delta rule).
//
// q / k [B, T, Hk, Dk], v [B, T, Hv, Dv], g / beta [B, T, Hv], state [B, Hv, Dv, Dk] (float32),
// all row-contiguous, Dk a multiple of 32 up to 256. One 32-lane SIMD-group (warp) per state row
// (b, hv, dv); lane l keeps the row's Dk/32 floats from l * Dk/32 in registers. For t = 0 .. T-1:
//   s_i  = s_i * g_t                               (decay)
//   kv   = sum_i s_i * k_ti                        (per lane in order of i, then the xor butterfly)
//   d    = (v_t - kv) * beta_t
//   s_i  = s_i + k_ti * d
//   y_t  = sum_i s_i * q_ti                        (the same two-level sum; only when WITH_Y)
// The xor butterfly leaves every lane with the same bits (IEEE addition commutes), and nothing a
// position computes depends on T: replaying m positions in one call is bitwise m calls of one
// position, which is what makes a replayed rollback equal plain decoding when both run this body.
// Value head hv reads key head hv / (Hv / Hk).
#ifndef MLX_DSPARK_GDN_REPLAY_H
#define MLX_DSPARK_GDN_REPLAY_H

#define DS_GR_MAX_DK 256  // largest key head dimension (8 floats per lane)
#define DS_GR_THREADS 128  // threads per threadgroup: 4 state rows

DS_FUNC float ds_gr_warp_sum(float x) {
  for (uint m = DS_WARP / 2; m > 0; m >>= 1) x += ds_shfl_xor_f32(x, m);
  return x;
}

template <bool WITH_Y, typename QP, typename KP, typename VP, typename GP, typename BP, typename SP,
          typename OP, typename YP>
DS_FUNC void ds_gr_row(QP q, KP k, VP v, GP g, BP beta, SP s0, OP s_out, YP y, int T, int Hk, int Hv,
                       int Dk, int Dv, int row, uint lane) {
  const int npl = Dk / DS_WARP;  // state floats per lane
  const int dv = row % Dv;
  const int bh = row / Dv;
  const int hv = bh % Hv;
  const int b = bh / Hv;
  const int hk = hv / (Hv / Hk);
  const int i0 = (int)lane * npl;
  float s[DS_GR_MAX_DK / DS_WARP];
  const ds_i64 srow = (ds_i64)row * Dk + i0;
  for (int i = 0; i < npl; ++i) s[i] = ds_to_float(s0[srow + i]);
  for (int t = 0; t < T; ++t) {
    const ds_i64 kt = (((ds_i64)b * T + t) * Hk + hk) * Dk + i0;
    const ds_i64 gt = ((ds_i64)b * T + t) * Hv + hv;
    const float decay = ds_to_float(g[gt]);
    const float bt = ds_to_float(beta[gt]);
    float kv = 0.0f;
    for (int i = 0; i < npl; ++i) {
      s[i] = s[i] * decay;
      kv += s[i] * ds_to_float(k[kt + i]);
    }
    kv = ds_gr_warp_sum(kv);
    const float d = (ds_to_float(v[gt * Dv + dv]) - kv) * bt;
    for (int i = 0; i < npl; ++i) s[i] = s[i] + ds_to_float(k[kt + i]) * d;
    if (WITH_Y) {
      float acc = 0.0f;
      for (int i = 0; i < npl; ++i) acc += s[i] * ds_to_float(q[kt + i]);
      acc = ds_gr_warp_sum(acc);
      if (lane == 0) y[gt * Dv + dv] = acc;
    }
  }
  for (int i = 0; i < npl; ++i) s_out[srow + i] = s[i];
}

#endif  // MLX_DSPARK_GDN_REPLAY_H
