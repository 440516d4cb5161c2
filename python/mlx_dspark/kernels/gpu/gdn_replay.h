// gdn_replay.h: the Gated DeltaNet recurrence replayed over T recorded positions, for rolling a
// hybrid target's recurrent state back to an accept point. One body over ds_portable.h.
// Semantics: kernels/gdn_replay.py::gdn_replay_reference (mlx-lm's scalar-gated delta rule).
//
// q / k [B, T, Hk, Dk], v [B, T, Hv, Dv], g / beta [B, T, Hv], state [B, Hv, Dv, Dk] (float32),
// all row-contiguous. One thread per state row (b, hv, dv): the row's Dk floats stay in the
// thread; for t = 0 .. T-1, in order:
//   s_i  = s_i * g_t                      (decay)
//   kv   = sum_i s_i * k_ti               (sequential in i)
//   d    = (v_t - kv) * beta_t
//   s_i  = s_i + k_ti * d
//   y_t  = sum_i s_i * q_ti               (sequential in i; only when WITH_Y)
// so a row's arithmetic per position never depends on T (replaying m positions in one call is
// bitwise m calls of one position), and the same body serves a forward (y and the state) and a
// replay (the state only). Value head hv reads key head hv / (Hv / Hk).
#ifndef MLX_DSPARK_GDN_REPLAY_H
#define MLX_DSPARK_GDN_REPLAY_H

#define DS_GR_MAX_DK 256  // largest key head dimension
#define DS_GR_THREADS 64  // threads per threadgroup

template <bool WITH_Y, typename QP, typename KP, typename VP, typename GP, typename BP, typename SP,
          typename OP, typename YP>
DS_FUNC void ds_gr_row(QP q, KP k, VP v, GP g, BP beta, SP s0, OP s_out, YP y, int T, int Hk, int Hv,
                       int Dk, int Dv, int row) {
  const int dv = row % Dv;
  const int bh = row / Dv;
  const int hv = bh % Hv;
  const int b = bh / Hv;
  const int hk = hv / (Hv / Hk);
  float s[DS_GR_MAX_DK];
  const ds_i64 srow = (ds_i64)row * Dk;
  for (int i = 0; i < Dk; ++i) s[i] = ds_to_float(s0[srow + i]);
  for (int t = 0; t < T; ++t) {
    const ds_i64 kt = (((ds_i64)b * T + t) * Hk + hk) * Dk;
    const ds_i64 gt = ((ds_i64)b * T + t) * Hv + hv;
    const float decay = ds_to_float(g[gt]);
    const float bt = ds_to_float(beta[gt]);
    float kv = 0.0f;
    for (int i = 0; i < Dk; ++i) {
      s[i] = s[i] * decay;
      kv += s[i] * ds_to_float(k[kt + i]);
    }
    const float d = (ds_to_float(v[gt * Dv + dv]) - kv) * bt;
    for (int i = 0; i < Dk; ++i) s[i] = s[i] + ds_to_float(k[kt + i]) * d;
    if (WITH_Y) {
      float acc = 0.0f;
      for (int i = 0; i < Dk; ++i) acc += s[i] * ds_to_float(q[kt + i]);
      y[gt * Dv + dv] = acc;
    }
  }
  for (int i = 0; i < Dk; ++i) s_out[srow + i] = s[i];
}

#endif  // MLX_DSPARK_GDN_REPLAY_H
