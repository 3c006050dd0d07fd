// The small per-layer steps of a Llama-family decoder between its products, fp32, one call each.
//
// Why: with the linears at memory speed and attention native, what was left of a decode step
// outside them was ~25 torch ops per layer (an RMSNorm is 8, rotary on q and k 10, the two KV
// writes, the SiLU gate), each a dispatch costing more than its arithmetic on a few rows.
// Every row is computed on its own in a fixed order, so a row's result does not depend on the
// other rows of the step (the batch invariance the forward keeps everywhere).
//
// Built into the same libraries as packed_gemm.cpp (VW floats per vector).
#include <math.h>
#include <omp.h>
#include <string.h>

#ifndef VW
#error "VW (floats per vector) is set by setup.py"
#endif

#include "vec_math.h"

static inline int threads_for(long rows, int threads) { return rows >= 32 ? threads : 1; }

// out[t] = w * (x[t] / sqrt(mean(x[t]^2) + eps)), rows of H floats (H a multiple of VW).
extern "C" void dm_rms_norm(const float* x, long T, long H, const float* w, float eps, float* out, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads_for(T, threads)) if (T >= 32 && threads > 1)
  for (long t = 0; t < T; t++) {
    const float* xr = x + t * H;
    float* o = out + t * H;
    fvec acc = (fvec){};
    for (long i = 0; i < H; i += VW) {
      const fvec v = *(const fvec*)(xr + i);
      acc = v * v + acc;
    }
    float ss = 0.f;
    for (int i = 0; i < VW; i++) ss += acc[i];
    const float r = 1.0f / sqrtf(ss / (float)H + eps);
    for (long i = 0; i < H; i += VW) *(fvec*)(o + i) = *(const fvec*)(w + i) * (*(const fvec*)(xr + i) * r);
  }
}

// qkv: T rows of [q (Hq*D) | k (Hk*D) | v (Hk*D)]; cos, sin: T rows of D (the halves repeated, as
// transformers builds them). Writes q rotated to q_out (T, Hq, D), k rotated and v into the slab
// [rows][Hk][cap][D] at (row[t], slot[t]).
extern "C" void dm_rope_store(const float* qkv, long T, long Hq, long Hk, long D, const float* cos_t,
                              const float* sin_t, float* q_out, float* kslab, float* vslab, long cap,
                              const long* row, const long* slot, int threads) {
  const long width = (Hq + 2 * Hk) * D, half = D / 2;
#pragma omp parallel for schedule(static) num_threads(threads_for(T, threads)) if (T >= 32 && threads > 1)
  for (long t = 0; t < T; t++) {
    const float* src = qkv + t * width;
    const float* c = cos_t + t * D;
    const float* s = sin_t + t * D;
    for (long h = 0; h < Hq + Hk; h++) {
      const float* x = src + h * D;
      float* y = h < Hq ? q_out + (t * Hq + h) * D : kslab + ((row[t] * Hk + (h - Hq)) * cap + slot[t]) * D;
      for (long i = 0; i < half; i++) y[i] = x[i] * c[i] - x[i + half] * s[i];
      for (long i = half; i < D; i++) y[i] = x[i] * c[i] + x[i - half] * s[i];
    }
    for (long h = 0; h < Hk; h++)
      memcpy(vslab + ((row[t] * Hk + h) * cap + slot[t]) * D, src + (Hq + Hk + h) * D, D * sizeof(float));
  }
}

// out (T, I) = silu(gu[:, :I]) * gu[:, I:], gu (T, 2I).
extern "C" void dm_silu_mul(const float* gu, long T, long I, float* out, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads_for(T, threads)) if (T >= 32 && threads > 1)
  for (long t = 0; t < T; t++) {
    const float* g = gu + t * 2 * I;
    const float* u = g + I;
    float* o = out + t * I;
    long i = 0;
    for (; i + VW <= I; i += VW) {
      const fvec gv = *(const fvec*)(g + i);
      *(fvec*)(o + i) = gv / (1.0f + vexp(-gv)) * *(const fvec*)(u + i);
    }
    for (; i < I; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
  }
}
