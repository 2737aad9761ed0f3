// One pool of worker threads for every native op.
//
// Sized like torch's intra-op pool (the Python side passes torch.get_num_threads()), and only
// busy while a native op runs: torch is idle then, because our ops are called synchronously
// from the model's forward.
//
// A job (parallel_for) is n tasks handed out one at a time from one atomic word: whoever is
// free takes the next task, the calling thread included. No task belongs to a thread, so a
// worker that is late (asleep, or descheduled because another process holds its core) never
// holds the job up: the others take its share, and the job waits only for tasks a thread has
// actually started. The word packs the job's generation with its next task and its task count,
// so a worker that wakes up after its job is over cannot take a task of the next one.
//
// Every wait is bounded, then blocks (docs/design/thread-pool.md):
// - an idle worker spins for the next job for spin_us (50 us by default, milliseconds while
//   torch runs on one thread during decode under kernels.split_threads: a decode step issues
//   dozens of small jobs back to back and waking a sleeping thread costs tens of
//   microseconds), yielding its core after the first few microseconds, then sleeps on a
//   condition variable;
// - the calling thread, its own tasks done, spins for the others' tasks in flight for a while,
//   yielding, then sleeps until the last of them wakes it.
// When a pool thread finds it was descheduled (a gap in its own spinning, or, for the calling
// thread, a new involuntary context switch), the CPU is shared: for the next 200 ms every wait
// spins for a few microseconds only, so that a spinning thread does not keep a core from a
// thread of ours that has work, and the workers sleep between jobs.
#pragma once

#include <sched.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <new>
#include <thread>
#include <vector>

namespace moerun {

// Set on a thread while it runs one lane of a pass split by tokens (NativeStack's lanes):
// the ops it calls run their tasks on that thread, in order, and never hand out a job.
inline thread_local bool t_pool_inline = false;

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
        // a worker's first job is the first one after the current word, however late it starts
        const uint32_t seen = gen_of(word_.load(std::memory_order_acquire));
        for (int i = 1; i < n; ++i) workers_.emplace_back([this, seen] { loop(seen); });
    }

    // Run f(task) for task in [0, n_tasks), spread over the pool; returns when all are done.
    // An exception from a task is rethrown here once every task has run.
    void parallel_for(int n_tasks, const std::function<void(int)>& f) {
        if (n_tasks <= 0) return;
        if (pid_ != getpid()) resize(n_);  // a forked child: its workers stayed in the parent
        if (n_ == 1 || n_tasks == 1 || t_pool_inline) {
            for (int t = 0; t < n_tasks; ++t) f(t);
            return;
        }
        if (n_tasks <= kMaxTasks) {
            run_job(n_tasks, f);
            return;
        }
        for (int first = 0; first < n_tasks; first += kMaxTasks) {  // more tasks than the word holds
            const std::function<void(int)> part = [&f, first](int t) { f(first + t); };
            run_job(std::min(kMaxTasks, n_tasks - first), part);
        }
    }

    // Whether a pool thread saw the CPU shared within the last kSharedHoldNs.
    bool cpu_shared() const { return shared(now_ns()); }

    // For tests: while held, a worker that sees a job waits (asleep) before it takes any task,
    // as a worker descheduled at that moment would; the jobs must complete without it.
    void hold_workers(bool on) {
        {
            std::lock_guard<std::mutex> lk(m_);
            held_.store(on, std::memory_order_seq_cst);
        }
        if (!on) cv_.notify_all();
    }
    // For tests: the thread running the current task is the calling thread of its job.
    static bool on_caller() { return t_caller; }

private:
    // word_: generation (24 bits) | task count (20 bits) | next task (20 bits)
    static constexpr int kTaskBits = 20;
    static constexpr uint64_t kTaskMask = (1ull << kTaskBits) - 1;
    static constexpr int kMaxTasks = (int)kTaskMask;
    static constexpr uint32_t kGenMask = (1u << (64 - 2 * kTaskBits)) - 1;
    static uint32_t gen_of(uint64_t w) { return (uint32_t)(w >> (2 * kTaskBits)); }
    static int count_of(uint64_t w) { return (int)((w >> kTaskBits) & kTaskMask); }
    static int next_of(uint64_t w) { return (int)(w & kTaskMask); }
    static uint64_t make_word(uint32_t gen, int count) { return ((uint64_t)gen << (2 * kTaskBits)) | ((uint64_t)count << kTaskBits); }

    // Waits: spin with PAUSE, reading the clock every kCheckEvery rounds (PAUSE costs 10-150
    // cycles depending on the core); after kYieldAfterNs of it, also sched_yield at each
    // reading, so a thread of ours queued on this core runs at once.
    static constexpr int kCheckEvery = 32;
    static constexpr int64_t kYieldAfterNs = 20000;
    static constexpr int64_t kGapNs = 300000;          // a gap this long in a spin: we were descheduled
    static constexpr int64_t kSharedHoldNs = 200000000;  // shared mode lasts this long after a sign of it
    static constexpr int64_t kSharedSpinNs = 5000;     // ... and every wait spins this long, then blocks
    static constexpr int64_t kCallerSpinNs = 200000;   // the calling thread's wait for tasks in flight
    static constexpr int64_t kRusageEveryNs = 1000000;   // a thread reads its context switches this often

    static inline thread_local bool t_caller = false;

    static int64_t now_ns() {
        return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
    }
    static void cpu_relax() { __builtin_ia32_pause(); }
    bool shared(int64_t now) const { return now < shared_until_.load(std::memory_order_relaxed); }
    void note_shared(int64_t now) { shared_until_.store(now + kSharedHoldNs, std::memory_order_relaxed); }

    // A new involuntary context switch of this thread since its last look means another thread
    // took its core (read at most once a millisecond per thread: getrusage is a system call).
    void check_switches(int64_t now) {
#ifdef RUSAGE_THREAD
        thread_local int64_t at = 0;
        thread_local long seen = -1;
        if (now - at < kRusageEveryNs) return;
        at = now;
        struct rusage ru;
        if (getrusage(RUSAGE_THREAD, &ru) != 0) return;
        if (seen >= 0 && ru.ru_nivcsw != seen) note_shared(now);
        seen = ru.ru_nivcsw;
#else
        (void)now;
#endif
    }

    void run_job(int n_tasks, const std::function<void(int)>& f) {
        check_switches(now_ns());
        job_ = &f;
        error_ = nullptr;
        done_.store(0, std::memory_order_relaxed);
        gen_ = (gen_ + 1) & kGenMask;
        word_.store(make_word(gen_, n_tasks), std::memory_order_seq_cst);  // the job is out
        if (sleepers_.load(std::memory_order_seq_cst) > 0) {
            { std::lock_guard<std::mutex> lk(m_); }
            cv_.notify_all();
        }
        t_caller = true;
        const int mine = take_tasks(gen_);
        t_caller = false;
        if (mine && done_.fetch_add(mine, std::memory_order_acq_rel) + mine == n_tasks) {
            // every task done
        } else {
            wait_done(n_tasks);
        }
        job_ = nullptr;
        if (error_) {
            std::exception_ptr e = error_;
            error_ = nullptr;
            std::rethrow_exception(e);
        }
    }

    // Take and run tasks of generation `gen` until none is left; returns how many this thread ran.
    int take_tasks(uint32_t gen) {
        int ran = 0;
        uint64_t w = word_.load(std::memory_order_acquire);
        while (gen_of(w) == gen && next_of(w) < count_of(w)) {
            if (!word_.compare_exchange_weak(w, w + 1, std::memory_order_acq_rel, std::memory_order_acquire)) continue;
            // the task is ours, so the job (and job_) stays until it is done
            try {
                (*job_)(next_of(w));
            } catch (...) {
                std::lock_guard<std::mutex> lk(error_m_);
                if (!error_) error_ = std::current_exception();
            }
            ++ran;
            w = word_.load(std::memory_order_acquire);
        }
        return ran;
    }

    // Spin until ready() or for limit_ns (kSharedSpinNs at most while the CPU is shared);
    // returns ready(). A gap between two readings of the clock means this thread was
    // descheduled meanwhile: the CPU is shared.
    template <class Ready>
    bool spin_until(const Ready& ready, int64_t limit_ns) {
        const int64_t start = now_ns();
        int64_t last = start;
        for (int i = 1;; ++i) {
            if (ready()) return true;
            cpu_relax();
            if (i % kCheckEvery) continue;
            const int64_t t = now_ns();
            if (t - last > kGapNs) note_shared(t);
            last = t;
            if (t - start > (shared(t) ? std::min(limit_ns, kSharedSpinNs) : limit_ns)) return ready();
            if (t - start > kYieldAfterNs) sched_yield();
        }
    }

    // The calling thread, its own tasks done: wait for the tasks other threads have started.
    void wait_done(int n_tasks) {
        auto all_done = [&] { return done_.load(std::memory_order_acquire) == n_tasks; };
        if (spin_until(all_done, kCallerSpinNs)) return;
        caller_sleeping_.store(true, std::memory_order_seq_cst);
        if (done_.load(std::memory_order_seq_cst) != n_tasks) {
            std::unique_lock<std::mutex> lk(m_);
            done_cv_.wait(lk, all_done);
        }
        caller_sleeping_.store(false, std::memory_order_relaxed);
    }

    // A worker: wait for a job after generation `seen`; false when the pool stops.
    bool wait_job(uint32_t seen) {
        auto job_or_quit = [&] {
            return gen_of(word_.load(std::memory_order_acquire)) != seen || quit_.load(std::memory_order_relaxed);
        };
        if (!spin_until(job_or_quit, 1000ll * spin_us())) sleep_until_job(seen);
        if (held_.load(std::memory_order_acquire)) {  // tests: a worker held up before it takes a task
            std::unique_lock<std::mutex> lk(m_);
            cv_.wait(lk, [&] { return !held_.load(std::memory_order_relaxed) || quit_.load(std::memory_order_relaxed); });
        }
        return !quit_.load(std::memory_order_relaxed);
    }

    void sleep_until_job(uint32_t seen) {
        std::unique_lock<std::mutex> lk(m_);
        sleepers_.fetch_add(1, std::memory_order_seq_cst);
        cv_.wait(lk, [&] {
            return gen_of(word_.load(std::memory_order_seq_cst)) != seen || quit_.load(std::memory_order_relaxed);
        });
        sleepers_.fetch_sub(1, std::memory_order_relaxed);
    }

    void loop(uint32_t seen) {
        while (wait_job(seen)) {
            const uint64_t w = word_.load(std::memory_order_acquire);
            seen = gen_of(w);
            const int ran = take_tasks(seen);
            if (!ran) continue;  // the others had taken every task
            check_switches(now_ns());  // preempted during a task? (no gap in a spin shows that)
            // the count is that of the job the tasks were taken from: it cannot end before them
            if (done_.fetch_add(ran, std::memory_order_seq_cst) + ran == count_of(w) &&
                caller_sleeping_.load(std::memory_order_seq_cst)) {
                { std::lock_guard<std::mutex> lk(m_); }
                done_cv_.notify_one();
            }
        }
    }

    // After fork() only the forking thread exists in the child: drop the others unjoined.
    void forget_after_fork() {
        for (auto& t : workers_) t.detach();
        workers_.clear();
        new (&m_) std::mutex();
        new (&error_m_) std::mutex();
        new (&cv_) std::condition_variable();
        new (&done_cv_) std::condition_variable();
        sleepers_.store(0, std::memory_order_relaxed);
        caller_sleeping_.store(false, std::memory_order_relaxed);
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
    std::mutex m_, error_m_;
    std::condition_variable cv_, done_cv_;  // a new job (or quit, or release); the last task done
    alignas(64) std::atomic<uint64_t> word_{0};
    alignas(64) std::atomic<int> done_{0};
    alignas(64) std::atomic<int> sleepers_{0};
    std::atomic<bool> caller_sleeping_{false};
    std::atomic<int64_t> shared_until_{0};
    std::atomic<bool> quit_{false}, held_{false};
    uint32_t gen_ = 0;  // the calling thread's copy of the current generation
    const std::function<void(int)>* job_ = nullptr;
    std::exception_ptr error_;
};

// The process's one pool, sized by set_threads (defined in ops.cpp).
ThreadPool& pool();

}  // namespace moerun
