// sampling_accept.h: speculative-sampling accept, one body over ds_portable.h.
// One threadgroup per batch element b. Semantics: kernels/reference.py::sampling_accept_reference.
//
//   p [B, w, V] float32, q [B, w-1, V] float32 (HAS_Q) or one-hot proposals (!HAS_Q: q_j(d_j) = 1),
//   draft [B, w-1] int32, u [B, w-1] float32, ub [B] float32  ->  accepted [B], bonus [B] int32.
//
// 1. accept d_j iff u_j * q_j(d_j) < p_j(d_j) (float32; a token outside [0, V) reads p = q = 0,
//    so it is rejected); a = the first rejection, or w-1.
// 2. masses, in units of 2^-40: m_i = (int64)(clamp(x_i, 0, 1) * 2^40) (NaN -> 0), where
//    x = max(p_a - q_a, 0) when a < w-1 (q_a = one-hot(d_a) without q), else x = p_{w-1};
//    when a < w-1 and the residual's total M <= DS_SA_RESID_MIN (= floor(1e-8 * 2^40)),
//    x = p_a instead.
// 3. inverse CDF in exact integers: U = clamp(floor(ub * 2^24), 0, 2^24 - 1),
//    T = floor(M * U / 2^24); bonus = the smallest i with m_0 + ... + m_i > T.
//    If M == 0 (no mass at all), bonus = argmax(p_a) in mx.argmax order.
// Integer masses make the sum order-free, so every backend returns the same token.
#ifndef MLX_DSPARK_SAMPLING_ACCEPT_H
#define MLX_DSPARK_SAMPLING_ACCEPT_H

#define DS_SA_RESID_MIN 10995  // floor(1e-8 * 2^40): residual mass at or below it -> p_a
#define DS_SA_SCALE 1099511627776.0f  // 2^40

DS_FUNC ds_i64 ds_sa_mass(float x) {
  x = x > 0.0f ? x : 0.0f;  // NaN -> 0
  x = x < 1.0f ? x : 1.0f;
  return (ds_i64)(x * DS_SA_SCALE);
}

// Mass of element i: the residual against q (mode 0) or p itself (mode 1).
template <bool HAS_Q, typename PR, typename QR>
DS_FUNC ds_i64 ds_sa_elem(int mode, PR prow, QR qrow, int da, int i) {
  float pi = prow[i];
  if (mode == 1) return ds_sa_mass(pi);
  float qi = HAS_Q ? (float)qrow[i] : (i == da ? 1.0f : 0.0f);
  return ds_sa_mass(pi - qi);
}

// s64: shared ds_i64[36]; s_i: shared int[4]; sv/si: shared [32] scratch for the argmax.
template <bool HAS_Q, typename PP, typename QP, typename DP, typename UP, typename UBP, typename OP>
DS_FUNC void ds_sa_run(ds_ctx c, PP p, QP q, DP draft, UP u, UBP ub, int w, int V,
                       OP accepted, OP bonus, DS_SHARED ds_i64* s64, DS_SHARED int* s_i,
                       DS_SHARED float* sv, DS_SHARED int* si) {
  const int b = (int)c.bx;
  const int k = w - 1;
  const int lane = (int)ds_lane(c);
  const int warp = (int)ds_warp(c);
  const int nw = (int)(c.nthreads / DS_WARP);
  if (c.tid == 0) {
    int a = k;
    for (int j = 0; j < k; ++j) {
      int d = draft[b * k + j];
      float pj = 0.0f;
      float qj = 0.0f;
      if (d >= 0 && d < V) {
        pj = p[((ds_i64)b * w + j) * V + d];
        qj = HAS_Q ? (float)q[((ds_i64)b * k + j) * V + d] : 1.0f;
      }
      if (!(u[b * k + j] * qj < pj)) {
        a = j;
        break;
      }
    }
    s_i[0] = a;
  }
  DS_BARRIER();
  const int a = s_i[0];
  const int da = a < k ? draft[b * k + a] : -1;
  PP prow = p + ((ds_i64)b * w + a) * V;
  QP qrow = q + (HAS_Q && a < k ? ((ds_i64)b * k + a) * V : 0);
  const int cw = (V + nw - 1) / nw;  // each warp owns a contiguous chunk of V
  const int lo = warp * cw < V ? warp * cw : V;
  const int hi = lo + cw < V ? lo + cw : V;

  int mode = a < k ? 0 : 1;
  for (int pass = 0; pass < 2; ++pass) {
    ds_i64 s = 0;
    for (int i = lo + lane; i < hi; i += DS_WARP) s += ds_sa_elem<HAS_Q>(mode, prow, qrow, da, i);
    s = ds_warp_sum64(s);
    if (lane == 0) s64[warp] = s;
    DS_BARRIER();
    if (c.tid == 0) {
      ds_i64 m = 0;
      for (int j = 0; j < nw; ++j) m += s64[j];
      s64[32] = m;
      s_i[1] = (mode == 0 && m <= DS_SA_RESID_MIN) ? 1 : 0;
    }
    DS_BARRIER();
    if (s_i[1] == 0) break;
    mode = 1;
  }
  const ds_i64 M = s64[32];
  if (M == 0) {  // no mass anywhere: the most likely token of p_a
    float bv = ds_u2f(0xff800000u);
    int bi = 0x7fffffff;
    for (int i = (int)c.tid; i < V; i += (int)c.nthreads) {
      float x = prow[i];
      if (ds_argmax_better(x, i, bv, bi)) {
        bv = x;
        bi = i;
      }
    }
    ds_block_argmax(c, bv, bi, sv, si);
    if (c.tid == 0) {
      accepted[b] = a;
      bonus[b] = si[0];
    }
    return;
  }
  if (c.tid == 0) {
    float ubf = ub[b] * 16777216.0f;
    ds_i64 U = ubf > 0.0f ? (ubf < 16777215.0f ? (ds_i64)ubf : (ds_i64)16777215) : (ds_i64)0;
    ds_i64 T = (M >> 24) * U + (((M & (ds_i64)0xFFFFFF) * U) >> 24);
    ds_i64 excl = 0;
    int kw = 0;
    for (; kw < nw - 1; ++kw) {
      if (T < excl + s64[kw]) break;
      excl += s64[kw];
    }
    s64[33] = excl;
    s64[34] = T;
    s_i[2] = kw;
    accepted[b] = a;
  }
  DS_BARRIER();
  if (warp == s_i[2]) {
    ds_i64 base = s64[33];
    const ds_i64 T = s64[34];
    for (int t0 = lo; t0 < hi; t0 += DS_WARP) {
      int i = t0 + lane;
      ds_i64 m = i < hi ? ds_sa_elem<HAS_Q>(mode, prow, qrow, da, i) : (ds_i64)0;
      ds_i64 incl = ds_warp_incl_scan64(m, (uint)lane);
      int found = ds_warp_min_i32(base + incl > T ? i : 0x7fffffff);
      if (found != 0x7fffffff) {
        if (lane == 0) bonus[b] = found;
        break;
      }
      base += ds_shfl64(incl, DS_WARP - 1);
    }
  }
}

#endif  // MLX_DSPARK_SAMPLING_ACCEPT_H
