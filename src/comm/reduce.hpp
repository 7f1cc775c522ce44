// Element-wise reduction kernels shared by dt's own collective algorithms (shared memory today,
// sealed rings later).
//
// Contract: out[i] = in[0][i] op in[1][i] op ... op in[nin-1][i], combined in that order, so the
// result does not depend on how a buffer is cut into chunks or slices. bf16/f16 accumulate in float
// and round once at the end; f32 accumulates in float, f64 in double; integers in their own type
// (unsigned wrap-around for sums, as MPI's). With `divisor` > 1 (the second half of ReduceOp::avg)
// the accumulated value is divided by it before the single rounding (integers truncate toward
// zero). NaN in any input stays NaN for max and min. `out` may alias in[k] exactly (same pointer),
// never partially. Vectorised with AVX2 where the CPU has it, SSE2 otherwise.
#pragma once

#include <cstddef>

#include "dt/comm.hpp"
#include "dt/dtype.hpp"

namespace dt {

/// op must be sum, max or min, or avg (treated as sum; pass divisor for the division).
void reduce_elements(DType t, ReduceOp op, void* out, const void* const* in, int nin, std::size_t n,
                     int divisor = 1);

}  // namespace dt
