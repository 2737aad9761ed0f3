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
//   dozens of small jobs back to back, and waking a sleeping thread costs tens of
//   microseconds), yielding its core after the first 20 us, then sleeps on a condition variable;
// - the calling thread, its own tasks done, spins for tasks in flight on other threads for
//   200 us at most, yielding, then sleeps until the thread that ends the last one wakes it.
// When a pool thread finds it was descheduled (a gap in its spinning, or its run delay in
// /proc/thread-self/schedstat), the CPU is shared (another process wants our cores): for the
// next 200 ms every wait spins 5 us at most, and sleeping workers are no longer woken for
// jobs, so the calling thread runs them as one thread would, with the workers that happen
// to be awake; a sleeping worker looks every millisecond and takes a job it finds stuck
// (its calling thread descheduled).
#pragma once

#include <fcntl.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <functional>
#include <mutex>
#include <new>
#include <thread>
#include <vector>

namespace moerun {

class ThreadPool {
public:
    explicit ThreadPool(int n = 1) { resize(n); }
    ~ThreadPool() { stop(); }

    int size() const { return n_; }
    // The threads to cut a job's work for: size(), or 1 while the CPU is shared and every
    // worker sleeps (the calling thread then runs the job alone, as `--threads 1` would, tiles
    // and all). Read it once per op: it may change between two reads.
    int width() const {
        if (n_ == 1 || !shared(now_ns()) || sleepers_.load(std::memory_order_relaxed) < n_ - 1) return n_;
        return 1;
    }
    void set_spin_us(int us) { spin_us_.store(us < 0 ? 0 : us, std::memory_order_relaxed); }
    // Whether to watch for a shared CPU at all (on by default). Off while torch's own intra-op
    // threads run beside ours (a prefill): spinning after their parallel regions, they keep our
    // threads off their cores the way another process would, and would put an idle machine in
    // shared mode (kernels.split_threads turns it on for decode, where torch runs on one thread).
    void set_watch(bool on) { watch_.store(on, std::memory_order_relaxed); }
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
        if (n_ == 1 || n_tasks == 1) {
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
    // Counts since the pool was made, for benchmarks: signs of a shared CPU (gaps in a spin,
    // run delay of the calling thread, of a worker), tasks run by workers, stuck jobs a
    // napping worker took, jobs that woke sleeping workers.
    enum { kGap, kDelayCaller, kDelayWorker, kWorkerTasks, kRescues, kWakes, kStats };
    std::vector<long> stats() const {
        std::vector<long> out;
        for (const auto& c : stats_) out.push_back(c.load(std::memory_order_relaxed));
        return out;
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
    static constexpr int64_t kCallerSpinNs = 200000;  // the calling thread's spin for tasks in flight
    // The CPU is shared when a pool thread was descheduled: a gap of kGapNs in its spinning, or
    // a run delay (time runnable but off the CPU) over 1/kDelayShare of two windows in a row
    // of at least kProbeEveryNs (the calling thread looks as a job starts, a worker after the
    // tasks it ran; one look a window at most).
    static constexpr int64_t kGapNs = 300000;
    static constexpr int64_t kDelayShare = 4;
    static constexpr int64_t kProbeEveryNs = 10000000;
    // Shared mode lasts kSharedHoldNs after the last sign of it; then a wait spins kSharedSpinNs at
    // most, and a sleeping worker is not woken for jobs: it looks every kSharedNapNs and takes a
    // job it finds stuck at kStuckLooks looks in a row.
    static constexpr int64_t kSharedHoldNs = 200000000;
    static constexpr int64_t kSharedSpinNs = 5000;
    static constexpr int64_t kSharedNapNs = 1000000;
    static constexpr int kStuckLooks = 3;

    static inline thread_local bool t_caller = false;

    static int64_t now_ns() {
        return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
    }
    static void cpu_relax() { __builtin_ia32_pause(); }
    bool shared(int64_t now) const { return now < shared_until_.load(std::memory_order_relaxed); }
    void note_shared(int64_t now, int why) {
        if (!watch_.load(std::memory_order_relaxed)) return;
        if (!shared(now)) {  // workers asleep without a timeout take one now
            { std::lock_guard<std::mutex> lk(m_); }
            cv_.notify_all();
        }
        shared_until_.store(now + kSharedHoldNs, std::memory_order_relaxed);
        stats_[why].fetch_add(1, std::memory_order_relaxed);
    }

    // This thread's run delay (ns runnable but not running, /proc/thread-self/schedstat), -1
    // where the kernel keeps none. The file stays open, one per thread (reopened in a forked child).
    struct DelayProbe {
        int fd = -1;
        pid_t pid = 0;
        int64_t at = 0, delay = -1;
        bool waited = false;
        ~DelayProbe() {
            if (fd >= 0) close(fd);
        }
        int64_t read_delay() {
            if (pid != getpid()) {
                if (fd >= 0) close(fd);
                fd = open("/proc/thread-self/schedstat", O_RDONLY | O_CLOEXEC);
                pid = getpid();
                at = 0;
            }
            char buf[128];
            const ssize_t n = fd < 0 ? -1 : pread(fd, buf, sizeof buf - 1, 0);
            if (n <= 0) return -1;
            buf[n] = 0;
            char* p = buf;
            std::strtoull(p, &p, 10);  // "<on-CPU ns> <run delay ns> <time slices>"
            return std::strtoll(p, nullptr, 10);
        }
    };

    // Whether this thread waited for a core for more than 1/kDelayShare of the time since its
    // last look (at most one look per kProbeEveryNs: a read of a /proc file, ~2 us).
    void check_delay(int64_t now, int why) {
        thread_local DelayProbe probe;
        if (now - probe.at < kProbeEveryNs) return;
        const int64_t d = probe.read_delay();
        if (d < 0) return;
        const bool waited = probe.at > 0 && probe.delay >= 0 && (d - probe.delay) * kDelayShare > now - probe.at;
        if (waited && probe.waited) note_shared(now, why);  // two looks in a row: not a passing collision
        probe.waited = waited;
        probe.at = now;
        probe.delay = d;
    }

    void run_job(int n_tasks, const std::function<void(int)>& f) {
        const int64_t now = now_ns();
        check_delay(now, kDelayCaller);
        job_ = &f;
        error_ = nullptr;
        done_.store(0, std::memory_order_relaxed);
        gen_ = (gen_ + 1) & kGenMask;
        word_.store(make_word(gen_, n_tasks), std::memory_order_seq_cst);  // the job is out
        // Sleeping workers are woken, except while the CPU is shared: then the calling thread
        // runs the job with whichever workers are awake, as one thread would (the sleepers look
        // for unclaimed tasks every kSharedNapNs on their own, so a job whose calling thread
        // lost its core still ends).
        if (sleepers_.load(std::memory_order_seq_cst) > 0 && !shared(now)) {
            stats_[kWakes].fetch_add(1, std::memory_order_relaxed);
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
            if (t - last > kGapNs) note_shared(t, kGap);
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

    // Sleep until a job after generation `seen` (or quit). While the CPU is shared no one wakes
    // a sleeper for a job: it naps, and takes a job only when it finds it stuck: outstanding
    // with the same next task unclaimed at kStuckLooks looks in a row (its calling thread off
    // its core, or a task that waits on another task).
    void sleep_until_job(uint32_t seen) {
        std::unique_lock<std::mutex> lk(m_);
        sleepers_.fetch_add(1, std::memory_order_seq_cst);
        uint64_t napped_on = ~0ull;
        int looks = 0;
        for (;;) {
            if (quit_.load(std::memory_order_relaxed)) break;
            const uint64_t w = word_.load(std::memory_order_seq_cst);
            const bool is_shared = shared(now_ns());
            if (gen_of(w) != seen) {
                if (!is_shared) break;
                looks = w == napped_on && next_of(w) < count_of(w) ? looks + 1 : 0;
                if (looks >= kStuckLooks) {  // stuck: take it
                    stats_[kRescues].fetch_add(1, std::memory_order_relaxed);
                    break;
                }
                napped_on = w;
            }
            if (is_shared)
                cv_.wait_for(lk, std::chrono::nanoseconds(kSharedNapNs));
            else
                cv_.wait(lk);
        }
        sleepers_.fetch_sub(1, std::memory_order_relaxed);
    }

    void loop(uint32_t seen) {
        while (wait_job(seen)) {
            const uint64_t w = word_.load(std::memory_order_acquire);
            seen = gen_of(w);
            const int ran = take_tasks(seen);
            if (!ran) continue;  // the others had taken every task
            stats_[kWorkerTasks].fetch_add(ran, std::memory_order_relaxed);
            check_delay(now_ns(), kDelayWorker);  // held off its core during a task? (no gap in a spin shows that)
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
    std::atomic<bool> watch_{true};  // set_watch
    std::atomic<long> stats_[kStats] = {};
    std::atomic<bool> quit_{false}, held_{false};
    uint32_t gen_ = 0;  // the calling thread's copy of the current generation
    const std::function<void(int)>* job_ = nullptr;
    std::exception_ptr error_;
};

// The process's one pool, sized by set_threads (defined in ops.cpp).
ThreadPool& pool();

}  // namespace moerun
