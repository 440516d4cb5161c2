// greedy_accept.h: greedy verify-and-accept, one body over ds_portable.h.
//
// logits [B, w, V] row-contiguous (row r = b * w + j predicts the token after position j),
// draft [B, w-1] int32. Semantics: kernels/reference.py::greedy_accept_reference.
//
// The V axis of each row is cut into chunks of CH elements, so B * w * nch threadgroups share
// the read of the logits (nch = ceil(V / CH)):
//   ds_ga_partial   threadgroup (cx, r) writes the argmax of chunk cx of row r to
//                   pidx[r * nch + cx] and the bits of its value to pval[r * nch + cx];
//   ds_ga_finalize  for batch element b: target[b, j] = best partial of row (b, j) (mx.argmax
//                   order: NaN first, then larger, then smaller index), accepted[b] = length of
//                   the prefix where draft[b, j] == target[b, j], bonus[b] = target[b, accepted].
// CUDA runs both in one launch (the last threadgroup of batch element b to finish finalizes
// it); Metal dispatches them back to back on one encoder.
#ifndef MLX_DSPARK_GREEDY_ACCEPT_H
#define MLX_DSPARK_GREEDY_ACCEPT_H

#define DS_GA_MAX_W 128  // widest verify block the GPU path takes (the reference takes the rest)

template <typename LP, typename OP>
DS_FUNC void ds_ga_partial(ds_ctx c, LP logits, int V, int CH, int nch, OP pidx, OP pval,
                           DS_SHARED float* sv, DS_SHARED int* si) {
  const int cx = (int)c.bx;
  const int r = (int)c.by;
  const int start = cx * CH;
  const int end = start + CH < V ? start + CH : V;
  const ds_i64 base = (ds_i64)r * (ds_i64)V;
  float bv = ds_u2f(0xff800000u);  // -inf with the largest index: loses to any element
  int bi = 0x7fffffff;
  for (int i = start + (int)c.tid; i < end; i += (int)c.nthreads) {
    float x = ds_to_float(logits[base + i]);
    if (ds_argmax_better(x, i, bv, bi)) {
      bv = x;
      bi = i;
    }
  }
  ds_block_argmax(c, bv, bi, sv, si);
  if (c.tid == 0) {
    pidx[r * nch + cx] = si[0];
    pval[r * nch + cx] = (int)ds_f2u(sv[0]);
  }
}

template <typename DP, typename PP, typename OP>
DS_FUNC void ds_ga_finalize(ds_ctx c, int b, DP draft, int w, int nch, PP pidx, PP pval,
                            OP target, OP accepted, OP bonus, DS_SHARED int* s_tgt) {
  const int lane = (int)ds_lane(c);
  const int nw = (int)(c.nthreads / DS_WARP);
  for (int j = (int)ds_warp(c); j < w; j += nw) {
    const int r = b * w + j;
    float bv = ds_u2f(0xff800000u);
    int bi = 0x7fffffff;
    for (int k = lane; k < nch; k += DS_WARP) {
      float v = ds_u2f((ds_u32)pval[r * nch + k]);
      int i = pidx[r * nch + k];
      if (ds_argmax_better(v, i, bv, bi)) {
        bv = v;
        bi = i;
      }
    }
    ds_warp_argmax(bv, bi);
    if (lane == 0) {
      target[r] = bi;
      s_tgt[j] = bi;
    }
  }
  DS_BARRIER();
  if (c.tid == 0) {
    int a = 0;
    while (a < w - 1 && draft[b * (w - 1) + a] == s_tgt[a]) a++;
    accepted[b] = a;
    bonus[b] = s_tgt[a];
  }
}

#endif  // MLX_DSPARK_GREEDY_ACCEPT_H
