// Vector helpers shared by the native kernels (GCC vector extensions; VW floats per vector).
#pragma once

typedef float fvec __attribute__((vector_size(VW * 4), aligned(4)));
typedef int ivec __attribute__((vector_size(VW * 4), aligned(4)));

static inline fvec splat(float x) { return x - (fvec){}; }  // s - 0 is s for every s: a bare broadcast

// The lanes' sum by halving (lanes i and i + w, w = VW/2 .. 1): a fixed order, so a result depends
// only on v, and 4 vector adds where a lane-by-lane sum is 15 dependent scalar adds (the attention
// kernel takes one per key per head: as a chain it cost more than the dot products themselves).
typedef float f8 __attribute__((vector_size(32)));
typedef float f4 __attribute__((vector_size(16)));

static inline float hsum(fvec v) {
#if VW == 16
  union { fvec v; f8 h[2]; } u = {v};
  const f8 a = u.h[0] + u.h[1];
#else
  const f8 a = v;
#endif
  union { f8 v; f4 h[2]; } w = {a};
  const f4 b = w.h[0] + w.h[1];
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// exp(x), Cephes' expf (about 1 ulp): 0 below -87, exp(88) above 88.
static inline fvec vexp(fvec x) {
  const fvec lo = splat(-87.0f), hi = splat(88.0f);
  const fvec under = x < lo ? splat(0.f) : splat(1.f);
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  fvec fx = x * 1.44269504088896341f + 0.5f;
  fvec fl = __builtin_convertvector(__builtin_convertvector(fx, ivec), fvec);
  fl = fl > fx ? fl - 1.0f : fl;  // floor
  ivec n = __builtin_convertvector(fl, ivec);
  x = x - fl * 0.693359375f;
  x = x - fl * -2.12194440e-4f;
  fvec z = x * x;
  fvec y = splat(1.9875691500E-4f);
  y = y * x + 1.3981999507E-3f;
  y = y * x + 8.3334519073E-3f;
  y = y * x + 4.1665795894E-2f;
  y = y * x + 1.6666665459E-1f;
  y = y * x + 5.0000001201E-1f;
  y = y * z + x + 1.0f;
  ivec e = (n + 127) << 23;
  return y * (fvec)e * under;
}
