// The CPU kernels' worker threads (invariant_linear.cpp's weight passes, the attention ops'
// heads): one process-wide pool of hardware_concurrency - 1 workers (MLX_DSPARK_CPU_THREADS caps
// it, at most 16); the calling thread works too. One job runs at a time.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace dspark::cpu {

class Pool {
 public:
  static Pool& get() {
    static Pool* pool = new Pool();  // never destroyed: workers may outlive static destructors
    return *pool;
  }
  int size() const { return static_cast<int>(workers_.size()) + 1; }

  void run(int tasks, const std::function<void(int)>& fn) {
    if (tasks <= 1 || workers_.empty()) {
      for (int i = 0; i < tasks; ++i) fn(i);
      return;
    }
    std::unique_lock<std::mutex> call(call_mu_);  // one job at a time
    {
      std::lock_guard<std::mutex> lk(mu_);
      fn_ = &fn;
      tasks_ = tasks;
      next_.store(0);
      busy_ = static_cast<int>(workers_.size());
      ++generation_;
    }
    cv_.notify_all();
    work();
    std::unique_lock<std::mutex> lk(mu_);
    done_cv_.wait(lk, [&] { return busy_ == 0; });
    fn_ = nullptr;
  }

 private:
  Pool() {
    int n = static_cast<int>(std::thread::hardware_concurrency());
    if (const char* env = std::getenv("MLX_DSPARK_CPU_THREADS")) n = std::atoi(env);
    n = std::max(1, std::min(n, 16));
    for (int i = 1; i < n; ++i) workers_.emplace_back([this] { loop(); });
    for (auto& t : workers_) t.detach();
  }
  void work() {
    for (int i = next_.fetch_add(1); i < tasks_; i = next_.fetch_add(1)) (*fn_)(i);
  }
  void loop() {
    uint64_t seen = 0;
    for (;;) {
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return generation_ != seen; });
        seen = generation_;
      }
      work();
      std::lock_guard<std::mutex> lk(mu_);
      if (--busy_ == 0) done_cv_.notify_one();
    }
  }

  std::vector<std::thread> workers_;
  std::mutex call_mu_, mu_;
  std::condition_variable cv_, done_cv_;
  const std::function<void(int)>* fn_ = nullptr;
  int tasks_ = 0;
  int busy_ = 0;
  uint64_t generation_ = 0;
  std::atomic<int> next_{0};
};

// Runs fn(t) for t = 0 .. tasks - 1 over the pool (each task once, in any order).
inline void parallel_for(int tasks, const std::function<void(int)>& fn) { Pool::get().run(tasks, fn); }

}  // namespace dspark::cpu
