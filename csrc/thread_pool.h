// One pool of worker threads for every native op.
//
// Sized like torch's intra-op pool (the Python side passes torch.get_num_threads()), and only
// busy while a native op runs: torch is idle then, because our ops are called synchronously
// from the model's forward. After a job the workers spin for a short while (a decode step
// issues dozens of small jobs back to back; waking a sleeping thread costs tens of
// microseconds) and then sleep on a condition variable, so they do not steal cores from
// torch's own threads between our calls. How long they spin is a setting: 50 us by default,
// milliseconds while torch runs on one thread (decode under kernels.split_threads), where a
// spinning worker keeps its own core and is there the moment the next op starts.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <new>
#include <thread>
#include <unistd.h>
#include <vector>

namespace moerun {

class ThreadPool {
public:
    explicit ThreadPool(int n = 1) { resize(n); }
    ~ThreadPool() { stop(); }

    int size() const { return n_; }
    void set_spin_us(int us) { spin_us_.store(us < 0 ? 0 : us, std::memory_order_relaxed); }
    int spin_us() const { return spin_us_.load(std::memory_order_relaxed); }

    void resize(int n) {
        if (n < 1) n = 1;
        if (pid_ != getpid()) forget_after_fork();
        if (n == n_ && (int)workers_.size() == n - 1) return;
        stop();
        n_ = n;
        quit_ = false;
        // a worker's first job is the first generation after this one, however late it starts
        unsigned start = gen_.load(std::memory_order_acquire);
        for (int i = 1; i < n; ++i) workers_.emplace_back([this, start] { loop(start); });
    }

    // Run f(task) for task in [0, n_tasks), spread over the pool; returns when all are done.
    void parallel_for(int n_tasks, const std::function<void(int)>& f) {
        if (n_tasks <= 0) return;
        if (pid_ != getpid()) resize(n_);  // a forked child: its workers stayed in the parent
        if (n_ == 1 || n_tasks == 1) {
            for (int t = 0; t < n_tasks; ++t) f(t);
            return;
        }
        job_ = &f;
        n_tasks_ = n_tasks;
        next_.store(0, std::memory_order_relaxed);
        pending_.store(n_ - 1, std::memory_order_relaxed);
        {
            std::lock_guard<std::mutex> lk(m_);
            gen_.fetch_add(1, std::memory_order_release);
        }
        cv_.notify_all();
        work();
        while (pending_.load(std::memory_order_acquire) != 0) _mm_pause_();
        job_ = nullptr;
    }

private:
    static void _mm_pause_() { __builtin_ia32_pause(); }

    void work() {
        const std::function<void(int)>& f = *job_;
        for (int t; (t = next_.fetch_add(1, std::memory_order_relaxed)) < n_tasks_;) f(t);
    }

    void loop(unsigned seen) {
        for (;;) {
            // spin briefly for the next job (time-bounded: PAUSE costs 10-150 cycles
            // depending on the core), then sleep
            auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_us_.load(std::memory_order_relaxed));
            for (int spin = 0; gen_.load(std::memory_order_acquire) == seen && !quit_; ++spin) {
                _mm_pause_();
                if ((spin & 63) == 63 && std::chrono::steady_clock::now() > until) break;
            }
            if (gen_.load(std::memory_order_acquire) == seen && !quit_) {
                std::unique_lock<std::mutex> lk(m_);
                cv_.wait(lk, [&] { return gen_.load(std::memory_order_acquire) != seen || quit_; });
            }
            if (quit_) return;
            seen = gen_.load(std::memory_order_acquire);
            work();
            pending_.fetch_sub(1, std::memory_order_acq_rel);
        }
    }

    // After fork() only the forking thread exists in the child: drop the others unjoined.
    void forget_after_fork() {
        for (auto& t : workers_) t.detach();
        workers_.clear();
        new (&m_) std::mutex();
        new (&cv_) std::condition_variable();
        n_ = 0;
        pid_ = getpid();
    }

    void stop() {
        {
            std::lock_guard<std::mutex> lk(m_);
            quit_ = true;
        }
        cv_.notify_all();
        for (auto& t : workers_) t.join();
        workers_.clear();
    }

    std::atomic<int> spin_us_{50};  // a prefill step's native ops come closer together than this
    int n_ = 0;
    pid_t pid_ = getpid();
    std::vector<std::thread> workers_;
    std::mutex m_;
    std::condition_variable cv_;
    std::atomic<unsigned> gen_{0};
    std::atomic<int> next_{0}, pending_{0};
    int n_tasks_ = 0;
    const std::function<void(int)>* job_ = nullptr;
    std::atomic<bool> quit_{false};
};

// The process's one pool, sized by set_threads (defined in ops.cpp).
ThreadPool& pool();

}  // namespace moerun
