// Attention of a step's few new tokens over their rows of the batched KV slab, fp32.
//
// Why: in a decode or verify step each token attends over its row's cache (a few hundred keys) and
// its own ancestors in the row's tree. SDPA's CPU kernel pays a fixed price per call and per group
// of rows built around it (gathering the queries into a padded batch, a mask tensor per group,
// scattering the outputs back) that is larger than the arithmetic; measured inside a forward,
// where the weights' stream has just evicted the cache, one call for one token over 129 keys took
// ~0.25-0.6 ms, 30 of them per step. Here every (token, query head) is one item: read the token's
// visible keys straight from the slab, softmax, sum the values.
//
// A token sees slots [0, ctx) of its row (the committed cache, and the chain of new tokens that
// leads to it when they follow the cache directly) and then the slots listed in extra[off[i],
// off[i+1]) (its other ancestors, and itself). The result of an item depends only on its query,
// those keys and values and their order: a token's output is bitwise the same whatever else is in
// the step, which rows are batched with it or how many threads run.
//
// Built into the same libraries as packed_gemm.cpp (VW floats per vector).
#include <math.h>
#include <omp.h>
#include <vector>

#ifndef VW
#error "VW (floats per vector) is set by setup.py"
#endif

#include "vec_math.h"

// One (item, query head) pair: its scores over its visible keys, their softmax, the values' sum.
// scores: room for max_keys + VW floats.
static inline void attend_pair(long i, long h, const float* q, float* out, const long* items, long Hq, long Hk,
                               long D, const float* keys, const float* values, long cap, const long* row,
                               const long* ctx, const long* off, const long* extra, float scale, float* scores) {
  const long group = Hq / Hk, nd = D / VW, t = items[i];
  const float* qv = q + (t * Hq + h) * D;
  const long base = (row[i] * Hk + h / group) * cap * D;
  const float* kr = keys + base;
  const float* vr = values + base;
  const long c = ctx[i], e0 = off[i], ne = off[i + 1] - e0, nk = c + ne;
  fvec qs[16];  // D <= 16 * VW (checked by the caller)
  for (long d = 0; d < nd; d++) qs[d] = *(const fvec*)(qv + d * VW) * scale;
  float mx = -INFINITY;
  for (long j = 0; j < nk; j++) {
    const float* kj = kr + (j < c ? j : extra[e0 + j - c]) * D;
    fvec acc = qs[0] * *(const fvec*)kj;
    for (long d = 1; d < nd; d++) acc = qs[d] * *(const fvec*)(kj + d * VW) + acc;
    const float s = hsum(acc);
    scores[j] = s;
    mx = s > mx ? s : mx;
  }
  for (long j = nk; j < (nk + VW - 1) / VW * VW; j++) scores[j] = -INFINITY;
  float total = 0.f;
  for (long j = 0; j < nk; j += VW) {
    fvec p = vexp(*(fvec*)(scores + j) - mx);
    *(fvec*)(scores + j) = p;
    total += hsum(p);
  }
  fvec acc[16];
  for (long d = 0; d < nd; d++) acc[d] = splat(0.f);
  for (long j = 0; j < nk; j++) {
    const float* vj = vr + (j < c ? j : extra[e0 + j - c]) * D;
    const fvec p = splat(scores[j]);
    for (long d = 0; d < nd; d++) acc[d] = p * *(const fvec*)(vj + d * VW) + acc[d];
  }
  const float inv = 1.0f / total;
  float* o = out + (t * Hq + h) * D;
  for (long d = 0; d < nd; d++) *(fvec*)(o + d * VW) = acc[d] * inv;
}

// q: T x Hq x D (contiguous); out: same shape. items: token indices to compute (into q and out),
// row by row. keys/values: one layer's slab [rows][Hk][cap][D]. row, ctx: per item; off (n+1),
// extra: see above; rows_start (n_rows + 1): each row's first item.
//
// The work goes out in units of one row's KV head and up to CHUNK of its tokens (their query heads
// for that KV head), handed to the threads as they come free: a unit reads its KV head's keys and
// values into cache once for all its pairs, and a thread whose units read cold rows from memory
// is not waited for by one whose units find their row in cache. (Split by pair count, a row with a
// 12-node tree beside seven one-token rows left one thread streaming the seven rows and the other
// computing on one.) With fewer units than a few per thread (one row decoding one token: 3 units
// for 2 threads) the pairs are split evenly instead. Each pair's arithmetic does not depend on the
// split, so a token's output is bitwise the same either way.
extern "C" void dm_tree_attention(const float* q, float* out, long n, const long* items, long Hq, long Hk,
                                  long D, const float* keys, const float* values, long cap, const long* row,
                                  const long* ctx, const long* off, const long* extra, float scale,
                                  long max_keys, const long* rows_start, long n_rows, int threads) {
  const long group = Hq / Hk, work = n * Hq, CHUNK = 2;
  std::vector<long> unit_first, unit_last, unit_hk;
  for (long r = 0; r < n_rows; r++)
    for (long hk = 0; hk < Hk; hk++)
      for (long i = rows_start[r]; i < rows_start[r + 1]; i += CHUNK) {
        unit_first.push_back(i);
        unit_last.push_back(i + CHUNK < rows_start[r + 1] ? i + CHUNK : rows_start[r + 1]);
        unit_hk.push_back(hk);
      }
  const long units = (long)unit_first.size();
  const bool by_unit = units >= 4 * (long)threads;
#pragma omp parallel num_threads(threads) if (threads > 1 && work > 1)
  {
    std::vector<float> scores(max_keys + VW);
    if (by_unit) {
#pragma omp for schedule(dynamic, 1)
      for (long u = 0; u < units; u++)
        for (long i = unit_first[u]; i < unit_last[u]; i++)
          for (long h = unit_hk[u] * group; h < (unit_hk[u] + 1) * group; h++)
            attend_pair(i, h, q, out, items, Hq, Hk, D, keys, values, cap, row, ctx, off, extra, scale, scores.data());
    } else {
#pragma omp for schedule(static)
      for (long w = 0; w < work; w++)
        attend_pair(w / Hq, w % Hq, q, out, items, Hq, Hk, D, keys, values, cap, row, ctx, off, extra, scale,
                    scores.data());
    }
  }
}

// The calling convention above, for the Python side to check against a library built from an
// older source (an editable install not rebuilt): 2 added rows_start and n_rows.
extern "C" int dm_tree_attention_abi() { return 2; }
