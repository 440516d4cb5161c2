// invariant_attention.h: causal attention over a KV cache whose every query row is computed with
// the same arithmetic whatever the number of queries and whatever the cache holds past that row.
// One body over ds_portable.h. Semantics: kernels/invariant.py::invariant_attention_reference.
//
// q [B, H, Lq, D], k / v [B, Hkv, Lk, D] (any strides), causal aligned at the end: query row i
// sits at position p = Lk - Lq + i and sees keys 0..p (n = p + 1 of them). One threadgroup of
// DS_IA_THREADS threads per (query row, batch * head). The row reduces over ITS OWN n keys, in
// chunks of DS_IA_THREADS keys, in key order:
//   score of key j     one thread, a sequential float dot product over D (then * scale);
//   chunk max          exact (max is order-free);
//   weights            p_j = exp(s_j - m_new) for the chunk's valid keys;
//   running sum, acc   l = l * exp(m - m_new) + sum_j p_j, acc_d = acc_d * exp(m - m_new) +
//                      sum_j p_j v_jd, both sums sequential in j;
//   out_d = acc_d / l, rounded once to the output type.
// Every loop bound is n (the row's causal length), never Lk or Lq, so a plain decode step and a
// row of a verify block at the same position compute bit-identical outputs.
#ifndef MLX_DSPARK_INVARIANT_ATTENTION_H
#define MLX_DSPARK_INVARIANT_ATTENTION_H

#define DS_IA_THREADS 128  // threads per threadgroup = keys per chunk
#define DS_IA_MAX_D 256    // largest head dimension

#ifdef DS_METAL
DS_FUNC float ds_ia_exp(float x) { return metal::exp(x); }
#else
DS_FUNC float ds_ia_exp(float x) { return expf(x); }
#endif

DS_FUNC float ds_ia_max(float a, float b) { return a > b ? a : b; }

// Block max of v (one per thread); every thread gets it. red: shared scratch of nthreads/32.
DS_FUNC float ds_ia_block_max(ds_ctx c, float v, DS_SHARED float* red) {
  for (uint m = DS_WARP / 2; m > 0; m >>= 1) v = ds_ia_max(v, ds_shfl_xor_f32(v, m));
  if (ds_lane(c) == 0) red[ds_warp(c)] = v;
  DS_BARRIER();
  float r = red[0];
  for (uint w = 1; w < c.nthreads / DS_WARP; ++w) r = ds_ia_max(r, red[w]);
  return r;
}

// One query row. Offsets are element offsets; *_row / *_col the strides of the key axis and
// of D. sq: D floats; sp: nthreads floats; red: nthreads / 32 floats (all shared).
template <typename T, typename QP, typename KP, typename VP, typename OP>
DS_FUNC void ds_ia_row(ds_ctx c, QP q, ds_i64 q_off, ds_i64 q_col, KP k, ds_i64 k_off, ds_i64 k_row,
                       ds_i64 k_col, VP v, ds_i64 v_off, ds_i64 v_row, ds_i64 v_col, int D, int n,
                       float scale, OP out, ds_i64 o_off, DS_SHARED float* sq, DS_SHARED float* sp,
                       DS_SHARED float* red) {
  const int tid = (int)c.tid;
  const int NT = (int)c.nthreads;
  for (int d = tid; d < D; d += NT) sq[d] = ds_to_float(q[q_off + d * q_col]);
  DS_BARRIER();
  const float neg_inf = ds_u2f(0xff800000u);
  float m = neg_inf, l = 0.0f, acc0 = 0.0f, acc1 = 0.0f;
  const int d0 = tid, d1 = tid + NT;
  for (int c0 = 0; c0 < n; c0 += NT) {
    const int cn = n - c0 < NT ? n - c0 : NT;
    float s = neg_inf;
    if (tid < cn) {
      const ds_i64 kp = k_off + (ds_i64)(c0 + tid) * k_row;
      float dot = 0.0f;
      for (int d = 0; d < D; ++d) dot += sq[d] * ds_to_float(k[kp + d * k_col]);
      s = dot * scale;
    }
    const float m_new = ds_ia_max(m, ds_ia_block_max(c, s, red));
    sp[tid] = tid < cn ? ds_ia_exp(s - m_new) : 0.0f;
    DS_BARRIER();
    const float alpha = ds_ia_exp(m - m_new);  // 0 on the first chunk (m = -inf)
    float ls = 0.0f;
    for (int j = 0; j < cn; ++j) ls += sp[j];
    l = l * alpha + ls;
    if (d0 < D) {
      float a = 0.0f;
      ds_i64 vp = v_off + (ds_i64)c0 * v_row + d0 * v_col;
      for (int j = 0; j < cn; ++j) a += sp[j] * ds_to_float(v[vp + j * v_row]);
      acc0 = acc0 * alpha + a;
    }
    if (d1 < D) {
      float a = 0.0f;
      ds_i64 vp = v_off + (ds_i64)c0 * v_row + d1 * v_col;
      for (int j = 0; j < cn; ++j) a += sp[j] * ds_to_float(v[vp + j * v_row]);
      acc1 = acc1 * alpha + a;
    }
    m = m_new;
    DS_BARRIER();  // sp and red are rewritten by the next chunk
  }
  if (d0 < D) out[o_off + d0] = ds_from_float<T>(acc0 / l);
  if (d1 < D) out[o_off + d1] = ds_from_float<T>(acc1 / l);
}

#endif  // MLX_DSPARK_INVARIANT_ATTENTION_H
