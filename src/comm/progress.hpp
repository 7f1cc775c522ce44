// dt::ProgressQueue: the communication progress thread of a rank ("dt-progress").
//
// Runs submitted operations one at a time, in submission order, on its own thread, so that
// communication goes on while the submitting thread computes (gradient buckets during backward).
// Each submit() returns a dt::Work that completes when the operation has run; an exception thrown
// by the operation is stored and rethrown by Work::wait()/test(). The thread blocks on a condition
// variable while idle (it never spins) and asks dt::qos for the communication tier's scheduling
// policy when it starts. Operations that use a communicator must be the only users of it while
// queued (MPI matches collectives by call order per communicator).
//
// Destruction waits for every queued operation to finish, then joins the thread; it never throws.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "dt/comm.hpp"

namespace dt {

class ProgressQueue {
 public:
  /// `rank` and `name` appear in error messages of the returned Works.
  ProgressQueue(int rank, std::string name);
  ~ProgressQueue();
  ProgressQueue(const ProgressQueue&) = delete;
  ProgressQueue& operator=(const ProgressQueue&) = delete;

  /// Queues `op`; `what` describes it for errors ("all_reduce(f32 x 1024, sum) on world").
  Work submit(std::string what, std::function<void()> op);
  /// True while operations are queued or running.
  bool busy() const;

  struct Task;

 private:
  void loop();
  int rank_;
  std::string name_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Task>> queue_;
  int running_ = 0;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace dt
