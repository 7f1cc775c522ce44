// dt::abandon: memory that a transport may still read or write after its operation was given up
// (a timed-out or dropped operation of a failing job, still pending in MPI or UCX) is kept until
// the process ends: never freed, never reused, and still reachable (no leak report). Costs
// nothing unless a job is failing. Thread-safe.
#pragma once

#include <cstdint>
#include <memory>

namespace dt {

void abandon(std::unique_ptr<std::uint8_t[]> p) noexcept;

}  // namespace dt
