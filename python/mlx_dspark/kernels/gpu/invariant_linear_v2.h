// invariant_linear_v2.h: the same function as invariant_linear.h (v1), bit for bit, with a faster
// memory side. Inputs, outputs, layouts and semantics: invariant_linear.h's header comment.
//
// What is the same (so every output element is v1's, bitwise, for every input): lane l of the warp
// that computes column n walks the DS_IL2_VEC = 8 consecutive elements of K that start at
// 8 * l + 256 * j, j = 0, 1, ... in order; every row accumulates fma(x, w, acc) in float from 0 in
// that order (w: the dense element, or fma(scale, q, bias) of the affine one); the 32 lane sums are
// added by the same xor tree (m = 16, 8, 4, 2, 1); the bias is added in float; one rounding to T.
// A row is computed alone: which pass, slot or neighbours it has never enters its arithmetic.
//
// What changes (the memory side only):
//   * vector loads: a lane's 8 elements of x and of a dense weight are 16-byte loads (ds_load8:
//     packed loads on Metal; on CUDA where the pointers are 16-byte aligned, else scalar loads);
//   * C (template, 1 / 2 / 4) consecutive columns of one weight per warp: each x load serves C
//     columns (v1: one), the weight loads of the C columns are independent (more bytes in flight);
//   * rows in passes of 8 (v1: 4), then 4 and 1: M = 5..8 read the weight row once (v1: twice), a
//     plain step (M = 1) runs a one-row pass (no repeated rows); a slot past the last row repeats
//     it, and is never stored;
//   * the R * C sums of a pass are stored by lanes (r * C + c) % 32 (v1: all by lane 0).
// No shared memory and no barrier: a warp past the last column returns at once.
//
// Warps: weight g (N_g columns) takes ceil(N_g / C) warps, in the order g = 0, 1, 2; warp w of the
// launch is warp (bx * nthreads / 32 + tid / 32). The last warp of a weight clamps its columns past
// N_g to N_g - 1 (read, never stored). Pointers of the G weights must have one type each (kind):
// on Metal, every input the launcher passes has at least 8 elements (device address space).
#ifndef MLX_DSPARK_INVARIANT_LINEAR_V2_H
#define MLX_DSPARK_INVARIANT_LINEAR_V2_H

#define DS_IL2_THREADS 128  // threads per threadgroup: 4 warps
#define DS_IL2_VEC 8        // consecutive elements of K per lane per step
#define DS_IL2_ROWS 8       // the most rows per pass

DS_FUNC float ds_il2_warp_sum(float v) {
  for (uint m = DS_WARP / 2; m > 0; m >>= 1) v += ds_shfl_xor_f32(v, m);
  return v;
}

// p[0..7] as float: vector loads (VL) or one element at a time; the same values.
template <bool VL, typename P>
DS_FUNC void ds_il2_load(P p, DS_THREAD float* o) {
  if (VL) {
    ds_load8(p, o);
  } else {
    for (int e = 0; e < DS_IL2_VEC; ++e) o[e] = ds_to_float(p[e]);
  }
}

// acc[r * C + c] += the lane's share of row (m0 + r) . weight column c, for this step's 8 weights
// wv[c * 8 .. c * 8 + 7] at element k.
template <int R, int C, bool VL, typename XP>
DS_FUNC void ds_il2_rows(XP x, int m0, int M, int K, int k, DS_THREAD const float* wv, DS_THREAD float* acc) {
  for (int r = 0; r < R; ++r) {
    const int m = m0 + r < M ? m0 + r : M - 1;
    float xv[DS_IL2_VEC];
    ds_il2_load<VL>(x + (ds_i64)m * K + k, xv);
    for (int c = 0; c < C; ++c)
      for (int e = 0; e < DS_IL2_VEC; ++e) acc[r * C + c] = ds_fma(xv[e], wv[c * DS_IL2_VEC + e], acc[r * C + c]);
  }
}

// The R * C sums of a pass: the xor tree, the bias, one rounding; stored for real rows and columns.
template <typename T, int R, int C, typename BP, typename OP>
DS_FUNC void ds_il2_store(DS_THREAD float* acc, int m0, int M, int n0, int N, bool has_bias, BP bias, OP out,
                          int lane) {
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      float s = ds_il2_warp_sum(acc[r * C + c]);
      if (lane == ((r * C + c) & (DS_WARP - 1)) && m0 + r < M && n0 + c < N) {
        if (has_bias) s += ds_to_float(bias[n0 + c]);
        out[(ds_i64)(m0 + r) * N + n0 + c] = ds_from_float<T>(s);
      }
    }
}

// One pass of R rows over C dense columns (weight rows at offsets wo[c]).
template <typename T, int R, int C, bool VL, typename XP, typename WP, typename BP, typename OP>
DS_FUNC void ds_il2_dense_pass(XP x, WP w, DS_THREAD const ds_i64* wo, bool has_bias, BP bias, OP out, int m0,
                               int M, int n0, int N, int K, int lane) {
  float acc[R * C];
  for (int i = 0; i < R * C; ++i) acc[i] = 0.0f;
  for (int k = lane * DS_IL2_VEC; k < K; k += DS_WARP * DS_IL2_VEC) {
    float wv[C * DS_IL2_VEC];
    for (int c = 0; c < C; ++c) ds_il2_load<VL>(w + wo[c] + k, wv + c * DS_IL2_VEC);
    ds_il2_rows<R, C, VL>(x, m0, M, K, k, wv, acc);
  }
  ds_il2_store<T, R, C>(acc, m0, M, n0, N, has_bias, bias, out, lane);
}

template <typename T, int C, bool VL, typename XP, typename WP, typename BP, typename OP>
DS_FUNC void ds_il2_dense_cols(XP x, WP w, bool has_bias, BP bias, OP out, int M, int n0, int N, int K,
                               int lane) {
  ds_i64 wo[C];
  for (int c = 0; c < C; ++c) wo[c] = (ds_i64)(n0 + c < N ? n0 + c : N - 1) * K;
  for (int m0 = 0; m0 < M;) {
    const int rem = M - m0;
    if (rem >= 5) {
      ds_il2_dense_pass<T, 8, C, VL>(x, w, wo, has_bias, bias, out, m0, M, n0, N, K, lane);
      m0 += 8;
    } else if (rem >= 2) {
      ds_il2_dense_pass<T, 4, C, VL>(x, w, wo, has_bias, bias, out, m0, M, n0, N, K, lane);
      m0 += 4;
    } else {
      ds_il2_dense_pass<T, 1, C, VL>(x, w, wo, has_bias, bias, out, m0, M, n0, N, K, lane);
      m0 += 1;
    }
  }
}

// Which weight and columns this warp takes: g (-1: none), its first column n0 (of weight g).
template <int C, int G>
DS_FUNC int ds_il2_warp_cols(ds_ctx c, int N0, int N1, int N2, DS_THREAD int& n0) {
  const int wg = (int)c.bx * ((int)c.nthreads / DS_WARP) + (int)ds_warp(c);
  const int W0 = (N0 + C - 1) / C, W1 = G > 1 ? (N1 + C - 1) / C : 0, W2 = G > 2 ? (N2 + C - 1) / C : 0;
  if (wg < W0) {
    n0 = wg * C;
    return 0;
  }
  if (G > 1 && wg < W0 + W1) {
    n0 = (wg - W0) * C;
    return 1;
  }
  if (G > 2 && wg < W0 + W1 + W2) {
    n0 = (wg - W0 - W1) * C;
    return 2;
  }
  n0 = 0;
  return -1;
}

// Dense weights w0..w(G-1) (unused ones may repeat w0); biases read only where HB says so.
template <typename T, int C, int G, int HB, typename XP, typename WP, typename BP, typename OP>
DS_FUNC void ds_il2_dense(ds_ctx c, XP x, WP w0, WP w1, WP w2, BP b0, BP b1, BP b2, OP o0, OP o1, OP o2, int M,
                          int N0, int N1, int N2, int K) {
  int n0;
  const int g = ds_il2_warp_cols<C, G>(c, N0, N1, N2, n0);
  if (g < 0) return;  // whole warps only: no barrier in the body
  const WP w = g == 0 ? w0 : (g == 1 ? w1 : w2);
  const BP b = g == 0 ? b0 : (g == 1 ? b1 : b2);
  const OP o = g == 0 ? o0 : (g == 1 ? o1 : o2);
  const int N = g == 0 ? N0 : (g == 1 ? N1 : N2);
  const bool hb = ((HB >> g) & 1) != 0;
  const int lane = (int)ds_lane(c);
  if (ds_aligned16(x) && ds_aligned16(w)) {  // K % 8 == 0: every row and lane offset is 16-byte aligned too
    ds_il2_dense_cols<T, C, true>(x, w, hb, b, o, M, n0, N, K, lane);
  } else {
    ds_il2_dense_cols<T, C, false>(x, w, hb, b, o, M, n0, N, K, lane);
  }
}

// One pass of R rows over C affine columns (packed rows at qo[c], scale / bias rows at so[c]);
// GS = log2(group): k >> GS == k / group for k >= 0.
template <typename T, int BITS, int R, int C, bool VL, typename XP, typename QP, typename SP, typename BP,
          typename OP>
DS_FUNC void ds_il2_affine_pass(XP x, QP wq, SP scales, SP biases, DS_THREAD const ds_i64* qo,
                                DS_THREAD const ds_i64* so, bool has_bias, BP bias, OP out, int m0, int M, int n0,
                                int N, int K, int GS, int lane) {
  const ds_u32 mask = (1u << BITS) - 1u;
  float acc[R * C];
  for (int i = 0; i < R * C; ++i) acc[i] = 0.0f;
  for (int k = lane * DS_IL2_VEC; k < K; k += DS_WARP * DS_IL2_VEC) {
    const ds_i64 bit0 = (ds_i64)k * BITS;
    const int sh0 = (int)(bit0 & 31);
    float wv[C * DS_IL2_VEC];
    for (int c = 0; c < C; ++c) {
      const ds_u32 q0 = wq[qo[c] + (bit0 >> 5)];
      const ds_u32 q1 = BITS == 8 ? wq[qo[c] + (bit0 >> 5) + 1] : 0u;
      const float s = ds_to_float(scales[so[c] + (k >> GS)]);
      const float b = ds_to_float(biases[so[c] + (k >> GS)]);
      for (int e = 0; e < DS_IL2_VEC; ++e) {
        const int bit = sh0 + e * BITS;
        const ds_u32 word = bit < 32 ? q0 : q1;
        wv[c * DS_IL2_VEC + e] = ds_fma(s, (float)((word >> (bit & 31)) & mask), b);
      }
    }
    ds_il2_rows<R, C, VL>(x, m0, M, K, k, wv, acc);
  }
  ds_il2_store<T, R, C>(acc, m0, M, n0, N, has_bias, bias, out, lane);
}

template <typename T, int BITS, int C, bool VL, typename XP, typename QP, typename SP, typename BP, typename OP>
DS_FUNC void ds_il2_affine_cols(XP x, QP wq, SP scales, SP biases, bool has_bias, BP bias, OP out, int M, int n0,
                                int N, int K, int group, int lane) {
  ds_i64 qo[C], so[C];
  for (int c = 0; c < C; ++c) {
    const ds_i64 n = n0 + c < N ? n0 + c : N - 1;
    qo[c] = n * (K * BITS / 32);
    so[c] = n * (K / group);
  }
  int GS = 0;
  while ((1 << GS) < group) ++GS;
  for (int m0 = 0; m0 < M;) {
    const int rem = M - m0;
    if (rem >= 5) {
      ds_il2_affine_pass<T, BITS, 8, C, VL>(x, wq, scales, biases, qo, so, has_bias, bias, out, m0, M, n0, N, K,
                                            GS, lane);
      m0 += 8;
    } else if (rem >= 2) {
      ds_il2_affine_pass<T, BITS, 4, C, VL>(x, wq, scales, biases, qo, so, has_bias, bias, out, m0, M, n0, N, K,
                                            GS, lane);
      m0 += 4;
    } else {
      ds_il2_affine_pass<T, BITS, 1, C, VL>(x, wq, scales, biases, qo, so, has_bias, bias, out, m0, M, n0, N, K,
                                            GS, lane);
      m0 += 1;
    }
  }
}

// Affine-quantized weights (MLX's layout), G of them with one BITS and one GROUP (a power of 2).
template <typename T, int BITS, int C, int G, int HB, typename XP, typename QP, typename SP, typename BP,
          typename OP>
DS_FUNC void ds_il2_affine(ds_ctx c, XP x, QP q0, SP s0, SP z0, QP q1, SP s1, SP z1, QP q2, SP s2, SP z2, BP b0,
                           BP b1, BP b2, OP o0, OP o1, OP o2, int M, int N0, int N1, int N2, int K, int group) {
  int n0;
  const int g = ds_il2_warp_cols<C, G>(c, N0, N1, N2, n0);
  if (g < 0) return;
  const QP q = g == 0 ? q0 : (g == 1 ? q1 : q2);
  const SP s = g == 0 ? s0 : (g == 1 ? s1 : s2);
  const SP z = g == 0 ? z0 : (g == 1 ? z1 : z2);
  const BP b = g == 0 ? b0 : (g == 1 ? b1 : b2);
  const OP o = g == 0 ? o0 : (g == 1 ? o1 : o2);
  const int N = g == 0 ? N0 : (g == 1 ? N1 : N2);
  const bool hb = ((HB >> g) & 1) != 0;
  const int lane = (int)ds_lane(c);
  if (ds_aligned16(x)) {
    ds_il2_affine_cols<T, BITS, C, true>(x, q, s, z, hb, b, o, M, n0, N, K, group, lane);
  } else {
    ds_il2_affine_cols<T, BITS, C, false>(x, q, s, z, hb, b, o, M, n0, N, K, group, lane);
  }
}

#endif  // MLX_DSPARK_INVARIANT_LINEAR_V2_H
