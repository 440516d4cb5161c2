// invariant_linear.h: y = x W^T (+ bias) for the few rows of a decode step or a verify round, each
// row computed with the same arithmetic whatever the number of rows. One body over ds_portable.h.
// Semantics: kernels/invariant_linear.py::invariant_linear_reference (the same sums, another order).
//
// x [M, K] T (row-contiguous), output [M, N] T. The weight is dense, W [N, K] T, or MLX's affine
// quantization: Wq [N, K * BITS / 32] uint32 (element k of a row sits at bit (k * BITS) % 32 of
// word (k * BITS) / 32, the first element in the low bits), scales / biases [N, K / GROUP] T, and
// w = scale * q + bias. K must be a multiple of DS_IL_VEC (the launcher checks).
//
// One warp per output column n (nthreads / 32 columns per threadgroup). For each row m in turn,
// the warp forms dot(x_m, w_n): lane l takes the DS_IL_VEC consecutive elements that start at
// DS_IL_VEC * l + DS_IL_VEC * 32 * j for j = 0, 1, ..., in order, accumulating x * w in float; the
// 32 lane sums are added by a fixed xor tree, the bias is added, and lane 0 rounds once to T.
// The row index enters only the pointers: row m of an M-row call runs the same instructions on
// the same values as the same row alone (M = 1), so its output is bit-identical by construction,
// and the weight row stays in cache for all M rows (read from memory once).
#ifndef MLX_DSPARK_INVARIANT_LINEAR_H
#define MLX_DSPARK_INVARIANT_LINEAR_H

#define DS_IL_THREADS 128  // threads per threadgroup: 4 output columns
#define DS_IL_VEC 8        // consecutive elements of K per lane per step

DS_FUNC float ds_il_warp_sum(float v) {
  for (uint m = DS_WARP / 2; m > 0; m >>= 1) v += ds_shfl_xor_f32(v, m);
  return v;
}

template <typename XP, typename WP>
DS_FUNC float ds_il_dense_dot(XP x, ds_i64 xo, WP w, ds_i64 wo, int K, int lane) {
  float acc = 0.0f;
  for (int k = lane * DS_IL_VEC; k < K; k += DS_WARP * DS_IL_VEC) {
    for (int e = 0; e < DS_IL_VEC; ++e) acc += ds_to_float(x[xo + k + e]) * ds_to_float(w[wo + k + e]);
  }
  return acc;
}

// BITS in {2, 4, 8}: a lane's DS_IL_VEC elements are 16, 32 or 64 bits of one row, within one
// group (GROUP >= 32) and starting at a bit offset that is a multiple of 16.
template <int BITS, typename XP, typename QP, typename SP>
DS_FUNC float ds_il_affine_dot(XP x, ds_i64 xo, QP wq, ds_i64 qo, SP scales, SP biases, ds_i64 so, int K,
                               int group, int lane) {
  const ds_u32 mask = (1u << BITS) - 1u;
  float acc = 0.0f;
  for (int k = lane * DS_IL_VEC; k < K; k += DS_WARP * DS_IL_VEC) {
    const ds_i64 bit0 = (ds_i64)k * BITS;
    const ds_u32 w0 = wq[qo + (bit0 >> 5)];
    const ds_u32 w1 = BITS == 8 ? wq[qo + (bit0 >> 5) + 1] : 0u;
    const int sh0 = (int)(bit0 & 31);
    const float s = ds_to_float(scales[so + k / group]);
    const float b = ds_to_float(biases[so + k / group]);
    for (int e = 0; e < DS_IL_VEC; ++e) {
      const int bit = sh0 + e * BITS;
      const ds_u32 word = bit < 32 ? w0 : w1;
      const float q = (float)((word >> (bit & 31)) & mask);
      acc += ds_to_float(x[xo + k + e]) * (s * q + b);
    }
  }
  return acc;
}

// Dense weight. bias is read only when HAS_BIAS.
template <typename T, bool HAS_BIAS, typename XP, typename WP, typename BP, typename OP>
DS_FUNC void ds_il_dense(ds_ctx c, XP x, WP w, BP bias, OP out, int M, int N, int K) {
  const int lane = (int)ds_lane(c);
  const int n = (int)c.bx * ((int)c.nthreads / DS_WARP) + (int)ds_warp(c);
  if (n >= N) return;  // whole warps only: no barrier below
  for (int m = 0; m < M; ++m) {
    float acc = ds_il_warp_sum(ds_il_dense_dot(x, (ds_i64)m * K, w, (ds_i64)n * K, K, lane));
    if (lane == 0) {
      if (HAS_BIAS) acc += ds_to_float(bias[n]);
      out[(ds_i64)m * N + n] = ds_from_float<T>(acc);
    }
  }
}

// Affine-quantized weight (MLX's layout above).
template <typename T, int BITS, bool HAS_BIAS, typename XP, typename QP, typename SP, typename BP, typename OP>
DS_FUNC void ds_il_affine(ds_ctx c, XP x, QP wq, SP scales, SP biases, BP bias, OP out, int M, int N, int K,
                          int group) {
  const int lane = (int)ds_lane(c);
  const int n = (int)c.bx * ((int)c.nthreads / DS_WARP) + (int)ds_warp(c);
  if (n >= N) return;
  const ds_i64 qo = (ds_i64)n * (K * BITS / 32);
  const ds_i64 so = (ds_i64)n * (K / group);
  for (int m = 0; m < M; ++m) {
    float acc = ds_il_warp_sum(ds_il_affine_dot<BITS>(x, (ds_i64)m * K, wq, qo, scales, biases, so, K, group, lane));
    if (lane == 0) {
      if (HAS_BIAS) acc += ds_to_float(bias[n]);
      out[(ds_i64)m * N + n] = ds_from_float<T>(acc);
    }
  }
}

#endif  // MLX_DSPARK_INVARIANT_LINEAR_H
