#include "progress.hpp"

#include <pthread.h>

#include <exception>
#include <utility>

#include "dt/qos.hpp"
#include "dt/trace.hpp"

namespace dt {

struct ProgressQueue::Task {
  std::string what;
  std::function<void()> op;
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  std::exception_ptr error;
};

namespace {

class QueuedWork final : public WorkImpl {
 public:
  QueuedWork(std::shared_ptr<ProgressQueue::Task> t, int rank) : t_(std::move(t)), rank_(rank) {}
  bool test() override {
    std::lock_guard<std::mutex> lk(t_->mu);
    if (t_->error) std::rethrow_exception(t_->error);
    return t_->done;
  }
  bool wait_for(Millis timeout) override {
    std::unique_lock<std::mutex> lk(t_->mu);
    auto ready = [&] { return t_->done; };
    if (timeout == kNoTimeout)
      t_->cv.wait(lk, ready);
    else if (!t_->cv.wait_for(lk, timeout, ready))
      return false;
    if (t_->error) std::rethrow_exception(t_->error);
    return true;
  }
  std::string describe() const override { return t_->what; }
  int rank() const override { return rank_; }

 private:
  std::shared_ptr<ProgressQueue::Task> t_;
  int rank_;
};

}  // namespace

ProgressQueue::ProgressQueue(int rank, std::string name)
    : rank_(rank), name_(std::move(name)), thread_([this] { loop(); }) {}

ProgressQueue::~ProgressQueue() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

Work ProgressQueue::submit(std::string what, std::function<void()> op) {
  auto t = std::make_shared<Task>();
  t->what = std::move(what);
  t->op = std::move(op);
  {
    std::lock_guard<std::mutex> lk(mu_);
    queue_.push_back(t);
  }
  cv_.notify_one();
  return Work(std::make_unique<QueuedWork>(std::move(t), rank_));
}

bool ProgressQueue::busy() const {
  std::lock_guard<std::mutex> lk(mu_);
  return !queue_.empty() || running_ > 0;
}

void ProgressQueue::loop() {
  pthread_setname_np(pthread_self(), "dt-progress");
  trace::set_thread_name("dt-progress");
  qos::apply_to_current_thread(qos::Role::comm);
  for (;;) {
    std::shared_ptr<Task> t;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stop requested and nothing left
      t = std::move(queue_.front());
      queue_.pop_front();
      ++running_;
    }
    std::exception_ptr err;
    try {
      t->op();
    } catch (...) {
      err = std::current_exception();
    }
    {
      std::lock_guard<std::mutex> lk(t->mu);
      t->done = true;
      t->error = err;
    }
    t->cv.notify_all();
    std::lock_guard<std::mutex> lk(mu_);
    --running_;
  }
}

}  // namespace dt
