// y[M, N] = x[M, K] @ W[N, K]^T (+ bias), fp32, over weights packed once at load.
//
// Why: a decode or verify step multiplies a handful of rows by every weight of the model, so it is
// bound by reading the weights; BLAS GEMM/GEMV kernels for 1-32 rows read them at a fraction of the
// memory bandwidth (draftmesh.packed_linear has the figures). Here the weights are packed once into
// blocks of NB output columns laid out k-major ([block][k][NB]), so each block streams contiguously
// through the cache while up to MRMAX rows are multiplied against it from registers: 1 to 8 rows cost
// about one read of the weights (software prefetches into L1 and L2 keep the stream ahead of the
// FMAs). A few tiles more (9-32 rows: a tree, or several rows' trees) share that read chunk by chunk
// from L1; beyond that the kernel is bound by the FMA units.
//
// Every output y[m, n] is one sequential fused multiply-add chain over k = 0..K-1 (then + bias[n]),
// whatever M, the row's place in the batch, the tile it falls in or the thread count: a row's result
// is bitwise the same alone or in any batch.
//
// Built twice by setup.py (no torch headers: it is loaded with ctypes, and its OpenMP calls resolve to
// the libgomp torch has already loaded, so they share torch's thread team):
//   AVX-512: VW=16 NV=3 MRMAX=8   AVX2: VW=8 NV=2 MRMAX=6   (both -mfma -ffp-contract=fast)
#include <omp.h>
#include <string.h>

#ifndef VW
#error "VW (floats per vector), NV (vectors per block) and MRMAX (rows per register tile) are set by setup.py"
#endif

typedef float vec __attribute__((vector_size(VW * 4), aligned(VW * 4)));

#define NB (NV * VW)
#define MPANEL 64  // rows of one tile: a weight block is reused from cache over this many rows
#define PREFETCH_K ((1024 + NB * 4 - 1) / (NB * 4))  // read the weights ~1 KB ahead of the FMAs
// Temporal (prefetcht0), not non-temporal: prefetchnta kept each block out of L2, so on an Intel
// AVX-512 box every 8-row pass after the first read it from memory again (64 rows cost 4.4x, and
// one row 1.6x, what they cost with prefetcht0 over 1 GB of weights).
#define PREFETCH_HINT 3
// And into L2 (prefetcht1) ~4 KB ahead: from 4 rows on, a tile spends long enough on each block
// that ~1 KB ahead leaves too few cache lines in flight to cover memory latency, so the FMAs and
// the weight stream took turns. SmolLM2-135M's linears and head, 2 threads, the AVX-512 box, ms:
// 1 row 23.2 -> 23.1, 4 rows 26.5 -> 23.7, 8 rows 30.6 -> 25.1, 16 rows 38.4 -> 33.4 (medians of 8
// interleaved passes; 8 KB ahead: 23.6 / 23.8 / 25.4 / 34.1, 16 KB: 24.4 / 24.2 / 26.0 / 34.2).
#define PREFETCH_L2_BYTES 4096
// k's per chunk when a panel holds a few tiles: 8 KB of a block, which stays in L1 while every tile
// of the panel multiplies it. SmolLM2-135M's linears and head, 2 threads, the AVX-512 box, ms, before
// -> with chunks: 8 rows 20.7 -> 20.7, 9 rows 24.6 -> 21.7, 10 24.6 -> 22.3, 12 25.8 -> 23.6, 16 28.3
// -> 26.6 (4 KB chunks 25.7, 12 KB 27.5); the AVX2 build there: 7 rows 27.8 -> 24.9, 8 28.1 -> 25.5,
// 16 39.6 -> 35.9; 64 rows 68.7 -> 73.2 (hence CHUNK_ROWS).
#define KC_BYTES 8192
#define KC ((KC_BYTES + NB * 4 - 1) / (NB * 4))
#define CHUNK_ROWS 32  // up to 32 rows a panel is chunked: about even there, worse beyond
#define RUNS_PER_THREAD 4  // runs of weight blocks handed out per thread (see dm_packed_mm)

extern "C" long dm_block_width(void) { return NB; }

template <int MR, bool STREAM>
static inline void tile(const float* __restrict x, long K, long k0, long k1, const float* __restrict p,
                        float* __restrict part) {
  // Partial sums over k < k0 come in part[MR][NB] and those over k < k1 go back there: a fp32 store
  // and load are exact, so each output stays one sequential FMA chain however k is split.
  vec acc[MR][NV];
  for (int m = 0; m < MR; m++)
    for (int j = 0; j < NV; j++) acc[m][j] = k0 ? *(const vec*)(part + m * NB + j * VW) : (vec){};
  for (long k = k0; k < k1; k++) {
    if (STREAM) {  // this tile is the first to read these weights: fetch them ahead
      // The stream prefetchers alone fall behind once a tile computes more than a row or two:
      // measured on a 2-core AVX2 box, 8 rows cost 1.55x one row without this and 1.38x with it.
      for (int b = 0; b < NB * 4; b += 64) __builtin_prefetch((const char*)(p + (k + PREFETCH_K) * NB) + b, 0, PREFETCH_HINT);
      for (int b = 0; b < NB * 4; b += 64) __builtin_prefetch((const char*)(p + k * NB) + PREFETCH_L2_BYTES + b, 0, 2);
    }
    vec w[NV];
    for (int j = 0; j < NV; j++) w[j] = *(const vec*)(p + k * NB + j * VW);
    for (int m = 0; m < MR; m++) {
      vec xb = x[m * K + k] - (vec){};  // a broadcast: s - 0 is s for every s, so no add is emitted
      for (int j = 0; j < NV; j++) acc[m][j] = xb * w[j] + acc[m][j];  // one FMA (-mfma -ffp-contract=fast)
    }
  }
  for (int m = 0; m < MR; m++)
    for (int j = 0; j < NV; j++) *(vec*)(part + m * NB + j * VW) = acc[m][j];
}

template <bool STREAM>
static inline void tile_rows(long mr, const float* x, long K, long k0, long k1, const float* p, float* part) {
  switch (mr) {
#define TILE(i) case i: tile<(i < MRMAX ? i : MRMAX), STREAM>(x, K, k0, k1, p, part); break;
    TILE(1) TILE(2) TILE(3) TILE(4) TILE(5) TILE(6) TILE(7)
    default: tile<MRMAX, STREAM>(x, K, k0, k1, p, part); break;
#undef TILE
  }
}

// x: M rows of K floats, contiguous; p: the packed weights (dm_block_width() columns per block, the
// last block zero-padded); bias: N floats or null; y: M rows of N floats.
extern "C" void dm_packed_mm(const float* x, long M, long K, const float* p, long N, const float* bias,
                             float* y, int threads) {
  const long nblk = (N + NB - 1) / NB;
  const long panels = (M + MPANEL - 1) / MPANEL;
  const long tiles = nblk * panels;
  // Tiles in block-major order, handed out in contiguous runs of blocks, a few runs per thread, to
  // whichever thread is free: a thread the OS preempts (a router, a proxy or a client sharing the
  // cores) delays the product by one run, not by its whole static half.
  long run = tiles / (threads * RUNS_PER_THREAD);
  if (run < 1) run = 1;
#pragma omp parallel for schedule(dynamic, run) num_threads(threads) if (threads > 1 && tiles > 1)
  for (long t = 0; t < tiles; t++) {
    const long b = t / panels, m1 = (t % panels) * MPANEL, m2 = m1 + MPANEL < M ? m1 + MPANEL : M;
    const float* pb = p + b * K * NB;
    const int nvalid = (int)(N - b * NB < NB ? N - b * NB : NB);
    const float* bb = bias ? bias + b * NB : nullptr;
    // A panel of a few tiles walks the block in chunks of KC k's, every tile over a chunk before
    // the next chunk: the first tile streams the weights from memory and the others read them from
    // L1. Whole, a block is read from L2 by every tile after the first, and at 9-16 rows that
    // second pass cost more than the extra FMAs (see KC_BYTES). Many tiles are bound by their FMAs,
    // and there the chunks' partial sums only add loads and stores: one chunk, as for one tile.
    const long kc = m2 - m1 > MRMAX && m2 - m1 <= CHUNK_ROWS ? KC : K;
    alignas(64) float part[MPANEL * NB];
    long k0 = 0;
    do {  // at least once: with K = 0 the tiles still write their (empty) sums
      const long k1 = k0 + kc < K ? k0 + kc : K;
      for (long m0 = m1; m0 < m2; m0 += MRMAX) {
        const long mr = m2 - m0 < MRMAX ? m2 - m0 : MRMAX;
        float* pm = part + (m0 - m1) * NB;
        if (m0 == m1 || kc == K)
          tile_rows<true>(mr, x + m0 * K, K, k0, k1, pb, pm);
        else
          tile_rows<false>(mr, x + m0 * K, K, k0, k1, pb, pm);
      }
      k0 = k1;
    } while (k0 < K);
    for (long m = m1; m < m2; m++) {
      float* out = part + (m - m1) * NB;
      if (bb)
        for (int j = 0; j < nvalid; j++) out[j] += bb[j];
      memcpy(y + m * N + b * NB, out, nvalid * sizeof(float));
    }
  }
}
