// invariant_gather.h: the MoE experts' product, out[p, m] = x[p / rep, m] W[idx[p]]^T, for the few rows of a
// decode step or a verify round, each output element computed with exactly the arithmetic the dense
// invariant kernel (invariant_linear.h) gives that row alone with that expert's weight. One body over
// ds_portable.h, after invariant_linear.h (whose accumulate / store / warp-sum helpers it calls, so the
// order of every sum is the dense kernel's by construction).
// Semantics: kernels/invariant_gather.py::invariant_gather_reference (mx.gather_mm / mx.gather_qmm with
// rhs_indices, transpose, in float32, rounded once).
//
// idx [P] (int32 or uint32): the expert of pair p (mlx-lm's SwitchLinear: pair = (token, k-th expert)).
// x [Xb, M, K] T row-contiguous, Xb = P / rep: pair p reads x batch p / rep (rep = k when the gate / up
// projections take one x per token for its k experts, 1 for the down projection and the sorted calls).
// Weights: dense W [E, N, K] T, or MLX's affine quantization per expert: Wq [E, N, K * BITS / 32] uint32,
// scales / biases [E, N, K / GROUP] T (the layout of invariant_linear.h, one matrix per expert).
// out [P, M, N] T. K must be a multiple of DS_IL_VEC (the launcher checks). An index past the last expert
// is clamped to it (never read out of bounds; mlx-lm's router cannot produce one). Two weights of one E
// and K may share a launch (mlx-lm's gate and up projections: same x, same idx), one output each.
//
// One warp per output column n (threadgroup x; a column of [N_0 | N_1] for two weights) and per chunk of
// DS_IL_ROWS consecutive rows r = p * M + m (threadgroup y). Inside a chunk, consecutive rows with the
// same expert form a block (at most DS_IL_ROWS: the dense kernel's block, with its repeated-last-row
// slots); the weight row of that expert is read once per block and every row of it runs the dense
// column's instruction sequence: lane l walks the DS_IL_VEC
// elements at DS_IL_VEC * l + DS_IL_VEC * 32 * j in order, fma in float, the fixed xor tree, one rounding.
// Which rows share a block (how many tokens the call has, whether mlx-lm sorted them by expert) changes
// no row's arithmetic: bit-identical to the row alone and to the dense kernel on W[idx[p]].
#ifndef MLX_DSPARK_INVARIANT_GATHER_H
#define MLX_DSPARK_INVARIANT_GATHER_H

// Expert of row r (clamped into [0, E)).
template <typename IP>
DS_FUNC int ds_ig_expert(IP idx, int r, int M, int E) {
  const ds_i64 e = (ds_i64)idx[r / M];
  return e < 0 ? 0 : (e >= E ? E - 1 : (int)e);
}

// The block of rows starting at r0 inside [r0, r1): its length (rows with r0's expert), and each slot's
// x offset (a slot past the block repeats the block's last row, as ds_il_rows does).
template <typename IP>
DS_FUNC int ds_ig_block(IP idx, int r0, int r1, int e, int M, int E, int rep, int K, DS_THREAD ds_i64* xo) {
  int len = 1;
  while (len < DS_IL_ROWS && r0 + len < r1 && ds_ig_expert(idx, r0 + len, M, E) == e) ++len;
  for (int s = 0; s < DS_IL_ROWS; ++s) {
    const int r = r0 + (s < len ? s : len - 1);
    const int p = r / M;
    xo[s] = ((ds_i64)(p / rep) * M + (r - p * M)) * K;
  }
  return len;
}

// Column n of dense experts W [E, N, K] over the rows [c0, c1) of one chunk.
template <typename T, typename XP, typename IP, typename WP, typename OP>
DS_FUNC void ds_ig_dense_rows(XP x, IP idx, WP w, OP out, int c0, int c1, int M, int n, int N, int K, int E,
                              int rep, int lane) {
  for (int r0 = c0; r0 < c1;) {
    const int e = ds_ig_expert(idx, r0, M, E);
    ds_i64 xo[DS_IL_ROWS];
    const int len = ds_ig_block(idx, r0, c1, e, M, E, rep, K, xo);
    const ds_i64 wo = ((ds_i64)e * N + n) * K;
    float acc[DS_IL_ROWS];
    for (int s = 0; s < DS_IL_ROWS; ++s) acc[s] = 0.0f;
    for (int k = lane * DS_IL_VEC; k < K; k += DS_WARP * DS_IL_VEC) {
      float wv[DS_IL_VEC];
      for (int i = 0; i < DS_IL_VEC; ++i) wv[i] = ds_to_float(w[wo + k + i]);
      ds_il_accumulate(x, xo, k, wv, acc);
    }
    ds_il_store<T, false>(acc, r0, r0 + len, n, N, out, out, lane);  // no bias: mlx-lm adds it after
    r0 += len;
  }
}

// Column n of affine-quantized experts, BITS in {2, 4, 8}, GROUP >= 32 (a lane's DS_IL_VEC elements lie in
// one group), over the rows [c0, c1) of one chunk.
template <typename T, int BITS, typename XP, typename IP, typename QP, typename SP, typename OP>
DS_FUNC void ds_ig_affine_rows(XP x, IP idx, QP wq, SP scales, SP biases, OP out, int c0, int c1, int M, int n,
                               int N, int K, int E, int rep, int group, int lane) {
  const ds_u32 mask = (1u << BITS) - 1u;
  for (int r0 = c0; r0 < c1;) {
    const int e = ds_ig_expert(idx, r0, M, E);
    ds_i64 xo[DS_IL_ROWS];
    const int len = ds_ig_block(idx, r0, c1, e, M, E, rep, K, xo);
    const ds_i64 qo = ((ds_i64)e * N + n) * (K * BITS / 32);
    const ds_i64 so = ((ds_i64)e * N + n) * (K / group);
    float acc[DS_IL_ROWS];
    for (int s = 0; s < DS_IL_ROWS; ++s) acc[s] = 0.0f;
    for (int k = lane * DS_IL_VEC; k < K; k += DS_WARP * DS_IL_VEC) {
      const ds_i64 bit0 = (ds_i64)k * BITS;  // the dequantization of ds_il_affine_column, step for step
      const ds_u32 w0 = wq[qo + (bit0 >> 5)];
      const ds_u32 w1 = BITS == 8 ? wq[qo + (bit0 >> 5) + 1] : 0u;
      const int sh0 = (int)(bit0 & 31);
      const float s = ds_to_float(scales[so + k / group]);
      const float b = ds_to_float(biases[so + k / group]);
      float wv[DS_IL_VEC];
      for (int i = 0; i < DS_IL_VEC; ++i) {
        const int bit = sh0 + i * BITS;
        const ds_u32 word = bit < 32 ? w0 : w1;
        wv[i] = ds_fma(s, (float)((word >> (bit & 31)) & mask), b);
      }
      ds_il_accumulate(x, xo, k, wv, acc);
    }
    ds_il_store<T, false>(acc, r0, r0 + len, n, N, out, out, lane);
    r0 += len;
  }
}

// G = 1 or 2 expert weights over one x and one idx (mlx-lm's gate and up projections: one launch), output g
// [P, M, N_g]; column n of the concatenation [N_0 | N_1] is weight g's column alone. Unused ones repeat 0.
template <typename T, int G, typename XP, typename IP, typename WP, typename OP>
DS_FUNC void ds_ig_dense(ds_ctx c, XP x, IP idx, WP w0, WP w1, OP o0, OP o1, int P, int M, int N0, int N1, int K,
                         int E, int rep) {
  const int lane = (int)ds_lane(c);
  const int n = (int)c.bx * ((int)c.nthreads / DS_WARP) + (int)ds_warp(c);
  const int R = P * M;
  const int c0 = (int)c.by * DS_IL_ROWS;
  if (c0 >= R) return;  // whole warps only: no barrier in the body
  const int c1 = c0 + DS_IL_ROWS < R ? c0 + DS_IL_ROWS : R;
  if (n < N0) {
    ds_ig_dense_rows<T>(x, idx, w0, o0, c0, c1, M, n, N0, K, E, rep, lane);
  } else if (G > 1 && n < N0 + N1) {
    ds_ig_dense_rows<T>(x, idx, w1, o1, c0, c1, M, n - N0, N1, K, E, rep, lane);
  }
}

template <typename T, int BITS, int G, typename XP, typename IP, typename QP, typename SP, typename OP>
DS_FUNC void ds_ig_affine(ds_ctx c, XP x, IP idx, QP q0, SP s0, SP z0, QP q1, SP s1, SP z1, OP o0, OP o1, int P,
                          int M, int N0, int N1, int K, int E, int rep, int group) {
  const int lane = (int)ds_lane(c);
  const int n = (int)c.bx * ((int)c.nthreads / DS_WARP) + (int)ds_warp(c);
  const int R = P * M;
  const int c0 = (int)c.by * DS_IL_ROWS;
  if (c0 >= R) return;
  const int c1 = c0 + DS_IL_ROWS < R ? c0 + DS_IL_ROWS : R;
  if (n < N0) {
    ds_ig_affine_rows<T, BITS>(x, idx, q0, s0, z0, o0, c0, c1, M, n, N0, K, E, rep, group, lane);
  } else if (G > 1 && n < N0 + N1) {
    ds_ig_affine_rows<T, BITS>(x, idx, q1, s1, z1, o1, c0, c1, M, n - N0, N1, K, E, rep, group, lane);
  }
}

#endif  // MLX_DSPARK_INVARIANT_GATHER_H
