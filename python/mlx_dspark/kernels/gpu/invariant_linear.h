// invariant_linear.h: y_g = x W_g^T (+ bias_g) for the few rows of a decode step or a verify round,
// for G = 1..3 weights that share the input (q/k/v, gate/up: one launch instead of G), each row
// computed with the same arithmetic whatever the number of rows. One body over ds_portable.h.
// Semantics: kernels/invariant_linear.py::invariant_linear_reference (the same sums, another order).
//
// x [M, K] T (row-contiguous); weight g is dense, W_g [N_g, K] T, or MLX's affine quantization:
// Wq_g [N_g, K * BITS / 32] uint32 (element k of a row sits at bit (k * BITS) % 32 of word
// (k * BITS) / 32, the first element in the low bits), scales / biases [N_g, K / GROUP] T, and
// w = fma(scale, q, bias); output g is [M, N_g] T. K must be a multiple of DS_IL_VEC (the launcher
// checks). HB: bit g set when weight g has a bias.
//
// One warp per output column n of the concatenation [N_0 | N_1 | N_2]. The rows go in blocks of
// DS_IL_ROWS; within a block, lane l walks the DS_IL_VEC consecutive elements that start at
// DS_IL_VEC * l + DS_IL_VEC * 32 * j for j = 0, 1, ..., in order, reads (and dequantizes) the weight
// elements once, and for every row of the block accumulates fma(x, w, acc) in float, in that order;
// each row's 32 lane sums are then added by a fixed xor tree, the bias is added, and lane 0 rounds
// once to T. A block past the last row repeats the last row's pointer (its results are not
// stored). So every row, in whichever block slot and whatever M, runs the same instruction
// sequence on the same values as the row alone (M = 1): bit-identical by construction, with the
// weight row read once per block of rows.
#ifndef MLX_DSPARK_INVARIANT_LINEAR_H
#define MLX_DSPARK_INVARIANT_LINEAR_H

#define DS_IL_THREADS 128  // threads per threadgroup: 4 output columns
#define DS_IL_VEC 8        // consecutive elements of K per lane per step
#define DS_IL_ROWS 4       // rows per pass over the weight row

DS_FUNC float ds_il_warp_sum(float v) {
  for (uint m = DS_WARP / 2; m > 0; m >>= 1) v += ds_shfl_xor_f32(v, m);
  return v;
}

// Row offsets of block m0 (a slot past M repeats the last row).
DS_FUNC void ds_il_rows(int m0, int M, int K, DS_THREAD ds_i64* xo) {
  for (int r = 0; r < DS_IL_ROWS; ++r) xo[r] = (ds_i64)(m0 + r < M ? m0 + r : M - 1) * K;
}

DS_FUNC void ds_il_fma_vec(DS_THREAD float* acc, DS_THREAD const float* xv, DS_THREAD const float* wv) {
  for (int e = 0; e < DS_IL_VEC; ++e) acc[0] = ds_fma(xv[e], wv[e], acc[0]);
}

template <typename XP>
DS_FUNC void ds_il_accumulate(XP x, DS_THREAD const ds_i64* xo, int k, DS_THREAD const float* wv,
                              DS_THREAD float* acc) {
  for (int r = 0; r < DS_IL_ROWS; ++r) {
    float xv[DS_IL_VEC];
    for (int e = 0; e < DS_IL_VEC; ++e) xv[e] = ds_to_float(x[xo[r] + k + e]);
    ds_il_fma_vec(acc + r, xv, wv);
  }
}

template <typename T, bool HAS_BIAS, typename BP, typename OP>
DS_FUNC void ds_il_store(DS_THREAD float* acc, int m0, int M, int n, int N, BP bias, OP out, int lane) {
  for (int r = 0; r < DS_IL_ROWS; ++r) {
    float s = ds_il_warp_sum(acc[r]);
    if (lane == 0 && m0 + r < M) {
      if (HAS_BIAS) s += ds_to_float(bias[n]);
      out[(ds_i64)(m0 + r) * N + n] = ds_from_float<T>(s);
    }
  }
}

// Column n of weight g: dense.
template <typename T, bool HAS_BIAS, typename XP, typename WP, typename BP, typename OP>
DS_FUNC void ds_il_dense_column(XP x, WP w, BP bias, OP out, int M, int n, int N, int K, int lane) {
  const ds_i64 wo = (ds_i64)n * K;
  for (int m0 = 0; m0 < M; m0 += DS_IL_ROWS) {
    ds_i64 xo[DS_IL_ROWS];
    ds_il_rows(m0, M, K, xo);
    float acc[DS_IL_ROWS];
    for (int r = 0; r < DS_IL_ROWS; ++r) acc[r] = 0.0f;
    for (int k = lane * DS_IL_VEC; k < K; k += DS_WARP * DS_IL_VEC) {
      float wv[DS_IL_VEC];
      for (int e = 0; e < DS_IL_VEC; ++e) wv[e] = ds_to_float(w[wo + k + e]);
      ds_il_accumulate(x, xo, k, wv, acc);
    }
    ds_il_store<T, HAS_BIAS>(acc, m0, M, n, N, bias, out, lane);
  }
}

// Column n of weight g: affine, BITS in {2, 4, 8}: a lane's DS_IL_VEC elements are 16, 32 or 64 bits
// of one row, within one group (GROUP >= 32) and starting at a bit offset that is a multiple of 16.
template <typename T, int BITS, bool HAS_BIAS, typename XP, typename QP, typename SP, typename BP, typename OP>
DS_FUNC void ds_il_affine_column(XP x, QP wq, SP scales, SP biases, BP bias, OP out, int M, int n, int N, int K,
                                 int group, int lane) {
  const ds_u32 mask = (1u << BITS) - 1u;
  const ds_i64 qo = (ds_i64)n * (K * BITS / 32);
  const ds_i64 so = (ds_i64)n * (K / group);
  for (int m0 = 0; m0 < M; m0 += DS_IL_ROWS) {
    ds_i64 xo[DS_IL_ROWS];
    ds_il_rows(m0, M, K, xo);
    float acc[DS_IL_ROWS];
    for (int r = 0; r < DS_IL_ROWS; ++r) acc[r] = 0.0f;
    for (int k = lane * DS_IL_VEC; k < K; k += DS_WARP * DS_IL_VEC) {
      const ds_i64 bit0 = (ds_i64)k * BITS;
      const ds_u32 w0 = wq[qo + (bit0 >> 5)];
      const ds_u32 w1 = BITS == 8 ? wq[qo + (bit0 >> 5) + 1] : 0u;
      const int sh0 = (int)(bit0 & 31);
      const float s = ds_to_float(scales[so + k / group]);
      const float b = ds_to_float(biases[so + k / group]);
      float wv[DS_IL_VEC];
      for (int e = 0; e < DS_IL_VEC; ++e) {
        const int bit = sh0 + e * BITS;
        const ds_u32 word = bit < 32 ? w0 : w1;
        wv[e] = ds_fma(s, (float)((word >> (bit & 31)) & mask), b);
      }
      ds_il_accumulate(x, xo, k, wv, acc);
    }
    ds_il_store<T, HAS_BIAS>(acc, m0, M, n, N, bias, out, lane);
  }
}

// Dense weights w0..w(G-1) (unused ones may repeat w0). Biases are read only where HB says so.
template <typename T, int G, int HB, typename XP, typename WP, typename BP, typename OP>
DS_FUNC void ds_il_dense(ds_ctx c, XP x, WP w0, WP w1, WP w2, BP b0, BP b1, BP b2, OP o0, OP o1, OP o2, int M, int N0,
                         int N1, int N2, int K) {
  const int lane = (int)ds_lane(c);
  const int n = (int)c.bx * ((int)c.nthreads / DS_WARP) + (int)ds_warp(c);
  if (n < N0) {  // whole warps only: no barrier in the body
    ds_il_dense_column<T, (HB & 1) != 0>(x, w0, b0, o0, M, n, N0, K, lane);
  } else if (G > 1 && n < N0 + N1) {
    ds_il_dense_column<T, (HB & 2) != 0>(x, w1, b1, o1, M, n - N0, N1, K, lane);
  } else if (G > 2 && n < N0 + N1 + N2) {
    ds_il_dense_column<T, (HB & 4) != 0>(x, w2, b2, o2, M, n - N0 - N1, N2, K, lane);
  }
}

// Affine-quantized weights (MLX's layout above), G of them with one BITS and one GROUP.
template <typename T, int BITS, int G, int HB, typename XP, typename QP, typename SP, typename BP, typename OP>
DS_FUNC void ds_il_affine(ds_ctx c, XP x, QP q0, SP s0, SP z0, QP q1, SP s1, SP z1, QP q2, SP s2, SP z2, BP b0, BP b1,
                          BP b2, OP o0, OP o1, OP o2, int M, int N0, int N1, int N2, int K, int group) {
  const int lane = (int)ds_lane(c);
  const int n = (int)c.bx * ((int)c.nthreads / DS_WARP) + (int)ds_warp(c);
  if (n < N0) {
    ds_il_affine_column<T, BITS, (HB & 1) != 0>(x, q0, s0, z0, b0, o0, M, n, N0, K, group, lane);
  } else if (G > 1 && n < N0 + N1) {
    ds_il_affine_column<T, BITS, (HB & 2) != 0>(x, q1, s1, z1, b1, o1, M, n - N0, N1, K, group, lane);
  } else if (G > 2 && n < N0 + N1 + N2) {
    ds_il_affine_column<T, BITS, (HB & 4) != 0>(x, q2, s2, z2, b2, o2, M, n - N0 - N1, N2, K, group, lane);
  }
}

#endif  // MLX_DSPARK_INVARIANT_LINEAR_H
