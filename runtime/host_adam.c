/* Adam and AdamW over one contiguous tensor, for the host's optimizer step (host_adam.py).
 *
 * One pass over the weight, its gradient and its two moments, in the order of operations of
 * torch's single-tensor loop (torch.optim.Adam/AdamW as built on the CPU): the lerp of the first
 * moment as torch's vectorized lerp fuses it, the second moment as its addcmul rounds it, the
 * denominator divided by sqrt(1 - beta2^t) rather than multiplied by its inverse. Compiled with
 * -ffp-contract=off, so that only the fmas written here are fused. A range [begin, end) of the
 * tensor per call lets the caller spread a tensor over threads. */
#include <math.h>
#include <stdint.h>

#define HARMONY_ADAM(NAME, T, SQRT, FMA)                                                         \
  void NAME(T* restrict p, const T* restrict g, T* restrict m, T* restrict v, int64_t begin,    \
            int64_t end, T sign, T l2, T decay, T lerp, int lerp_from_grad, T beta2,             \
            T one_minus_beta2, T bias2_sqrt, T eps, T neg_step) {                                \
    const T coeff = lerp_from_grad ? lerp - (T)1 : lerp;                                         \
    _Pragma("GCC unroll 8")                                                                      \
    for (int64_t i = begin; i < end; ++i) {                                                      \
      const T gi = FMA(p[i], l2, g[i] * sign);                                                   \
      const T pi = p[i] * decay;                                                                 \
      const T mi = FMA(coeff, gi - m[i], lerp_from_grad ? gi : m[i]);                            \
      const T vi = FMA(one_minus_beta2 * gi, gi, v[i] * beta2);                                  \
      m[i] = mi;                                                                                 \
      v[i] = vi;                                                                                 \
      p[i] = pi + (neg_step * mi) / (SQRT(vi) / bias2_sqrt + eps);                               \
    }                                                                                            \
  }

HARMONY_ADAM(harmony_adam_f32, float, sqrtf, fmaf)
HARMONY_ADAM(harmony_adam_f64, double, sqrt, fma)
