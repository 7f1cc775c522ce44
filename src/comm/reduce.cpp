#include "reduce.hpp"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "dt/error.hpp"

namespace dt {

namespace generic {
#include "reduce_impl.inc"
}  // namespace generic

#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace avx2 {
#include "reduce_impl.inc"
}  // namespace avx2
#pragma GCC pop_options
#define DT_HAVE_AVX2_KERNELS 1
#endif

void reduce_elements(DType t, ReduceOp op, void* out, const void* const* in, int nin, std::size_t n,
                     int divisor) {
  DT_ASSERT(nin >= 1, "reduce_elements needs at least one input");
  if (n == 0) return;
#ifdef DT_HAVE_AVX2_KERNELS
  static const bool has_avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (has_avx2) return avx2::reduce_any(t, op, out, in, nin, n, divisor);
#endif
  generic::reduce_any(t, op, out, in, nin, n, divisor);
}

}  // namespace dt
