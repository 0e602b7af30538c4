//! A small persistent thread pool for the host kernels.
//!
//! `num_threads() - 1` workers are started on first use and live for the process. [`run`] hands
//! a job's tasks out one at a time through an atomic counter, to the workers and to the calling
//! thread, and returns when every task has finished; so a slow or descheduled core delays only
//! the tasks it took, never the whole product. A worker spins briefly (`SPIN`) after each job
//! before parking, because decode issues hundreds of small products per token and waking a
//! parked thread costs tens of microseconds.
//!
//! One job runs at a time. A call made while the pool is busy (another thread's product, e.g.
//! another rank of a `LocalGroup`, or a task that itself calls [`run`]) runs its tasks inline
//! on the calling thread instead of waiting.

use std::any::Any;
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// How long an idle worker spins before it parks.
const SPIN: Duration = Duration::from_micros(50);

/// Worker threads for host kernels, the caller included: `TP_NUM_THREADS` if set to a positive
/// integer, else the machine's available parallelism. Read once.
pub fn num_threads() -> usize {
    static N: OnceLock<usize> = OnceLock::new();
    *N.get_or_init(|| {
        std::env::var("TP_NUM_THREADS")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .filter(|&n| n > 0)
            .or_else(|| std::thread::available_parallelism().ok().map(|n| n.get()))
            .unwrap_or(1)
    })
}

/// Runs `task(i)` for every `i` in `0..tasks`, on the pool's workers and the calling thread, and
/// returns once all have run. A panic in a task is re-raised here after the others finish.
pub(crate) fn run(tasks: usize, task: &(dyn Fn(usize) + Sync)) {
    let pool = pool();
    if tasks <= 1 || pool.workers.load(Ordering::Relaxed) == 0 || pool.busy.swap(true, Ordering::Acquire) {
        (0..tasks).for_each(task);
        return;
    }
    let job = Job { task, tasks, next: AtomicUsize::new(0), panic: Mutex::new(None) };
    pool.publish(&job);
    job.work();
    pool.close();
    pool.busy.store(false, Ordering::Release);
    let payload = job.panic.into_inner().unwrap_or_else(|e| e.into_inner());
    if let Some(p) = payload {
        resume_unwind(p);
    }
}

/// Runs `task(i)` for every `i` in `0..tasks` on the pool and the calling thread, each task's own
/// products running on its thread alone (the pool is busy with this job, so they run inline):
/// one dispatch for many small independent products (a mixture's experts in a decode step)
/// instead of one per product. Every task sees the calling thread's kernel family and
/// batch-invariance choice, so its products give the bits they would give on the caller.
pub fn par_tasks(tasks: usize, task: &(dyn Fn(usize) + Sync)) {
    let (kernel, invariant) = (crate::CpuKernel::current(), crate::matmul::batch_invariant());
    run(tasks, &|i| {
        let before = crate::matmul::batch_invariant();
        crate::matmul::set_batch_invariant(invariant);
        if crate::dispatch::with_kernel(kernel, || task(i)).is_err() {
            task(i);
        }
        crate::matmul::set_batch_invariant(before);
    });
}

/// Calls `f(first_row, rows)` on `data` cut into groups of whole rows of `row_len` elements (the
/// last row may be short), spread over the pool when the data is large enough to pay for it.
pub fn par_rows<E: Send, F>(data: &mut [E], row_len: usize, f: F)
where
    F: Fn(usize, &mut [E]) + Sync,
{
    /// Elements below which one thread does everything.
    const MIN_ELEMS: usize = 1 << 16;
    let groups = if data.len() < MIN_ELEMS { 1 } else { 4 * num_threads() };
    par_row_groups(data, row_len, groups, f)
}

/// Like [`par_rows`], but cut into (at most) `groups` groups of whole rows whatever the size of
/// `data`: for callers whose work per output row is large (attention over a long cache writes
/// few rows, each after reading thousands of keys). `groups <= 1` runs `f(0, data)` inline.
pub fn par_row_groups<E: Send, F>(data: &mut [E], row_len: usize, groups: usize, f: F)
where
    F: Fn(usize, &mut [E]) + Sync,
{
    let row_len = row_len.max(1);
    let rows = data.len().div_ceil(row_len);
    let groups = groups.min(rows);
    if groups < 2 {
        f(0, data);
        return;
    }
    let per = rows.div_ceil(groups);
    let base = TaskPtr(data.as_mut_ptr());
    let len = data.len();
    run(rows.div_ceil(per), &|g| {
        let base = &base;
        let start = g * per * row_len;
        let end = ((g + 1) * per * row_len).min(len);
        // SAFETY: groups are disjoint element ranges of `data` (which `run` outlives), each
        // handed to exactly one task.
        let part = unsafe { std::slice::from_raw_parts_mut(base.0.add(start), end - start) };
        f(g * per, part)
    });
}

/// A pointer shared with the pool's tasks, which use disjoint parts of what it points to (an
/// output the tasks write in parts, a buffer each fills its own part of).
#[derive(Clone, Copy)]
pub(crate) struct TaskPtr<E>(pub(crate) *mut E);
// SAFETY: used only inside `run` (or inline, on the calling thread), which returns after every
// task while the buffer it points into is borrowed; each task touches its own disjoint range.
unsafe impl<E: Send> Sync for TaskPtr<E> {}

impl<E> TaskPtr<E> {
    /// The pointer (a method, so closures capture the whole `TaskPtr`, not its raw field).
    pub(crate) fn get(self) -> *mut E {
        self.0
    }
}

/// One call's tasks.
struct Job<'a> {
    task: &'a (dyn Fn(usize) + Sync),
    tasks: usize,
    next: AtomicUsize,
    panic: Mutex<Option<Box<dyn Any + Send>>>,
}

impl Job<'_> {
    /// Claims and runs tasks until none is left.
    fn work(&self) {
        loop {
            let i = self.next.fetch_add(1, Ordering::Relaxed);
            if i >= self.tasks {
                return;
            }
            if let Err(p) = catch_unwind(AssertUnwindSafe(|| (self.task)(i))) {
                let mut slot = self.panic.lock().unwrap_or_else(|e| e.into_inner());
                slot.get_or_insert(p);
                // Skip the remaining tasks: the call is going to panic anyway.
                self.next.store(self.tasks, Ordering::Relaxed);
            }
        }
    }
}

// `state` packs three fields: the job's epoch (bits 17..), whether it is open to workers
// (bit 16) and how many workers are inside it (bits 0..16).
const OPEN: u64 = 1 << 16;
const INSIDE: u64 = OPEN - 1;
const EPOCH_SHIFT: u32 = 17;

struct Pool {
    /// Workers that started.
    workers: AtomicUsize,
    /// Set while a caller owns the pool.
    busy: AtomicBool,
    state: AtomicU64,
    /// The open job; valid while `state` says it is open or any worker is inside.
    job: AtomicPtr<()>,
    sleepers: AtomicUsize,
    lock: Mutex<()>,
    wake: Condvar,
}

fn pool() -> &'static Pool {
    static POOL: OnceLock<&'static Pool> = OnceLock::new();
    POOL.get_or_init(|| {
        let pool: &'static Pool = Box::leak(Box::new(Pool {
            workers: AtomicUsize::new(0),
            busy: AtomicBool::new(false),
            state: AtomicU64::new(0),
            job: AtomicPtr::new(std::ptr::null_mut()),
            sleepers: AtomicUsize::new(0),
            lock: Mutex::new(()),
            wake: Condvar::new(),
        }));
        // A worker that cannot be started is simply missing: tasks are claimed, not assigned,
        // so the pool works with the ones that run, and with none every call runs inline.
        for i in 1..num_threads() {
            let spawned = std::thread::Builder::new().name(format!("tp-cpu-{i}")).spawn(move || pool.worker());
            pool.workers.fetch_add(usize::from(spawned.is_ok()), Ordering::Relaxed);
        }
        pool
    })
}

impl Pool {
    /// Opens `job` to the workers. Called by the owner of `busy`.
    fn publish(&self, job: &Job<'_>) {
        // Only the owner of `busy` publishes, so the epoch read here is the last one published.
        let epoch = ((self.state.load(Ordering::Relaxed) >> EPOCH_SHIFT) + 1) & ((1 << (64 - EPOCH_SHIFT)) - 1);
        self.job.store((job as *const Job<'_>).cast_mut().cast(), Ordering::Relaxed);
        // SeqCst pairs with the sleepers protocol in `worker`: either a parking worker sees the
        // new state, or we see it counted in `sleepers` and wake it.
        self.state.store((epoch << EPOCH_SHIFT) | OPEN, Ordering::SeqCst);
        if self.sleepers.load(Ordering::SeqCst) > 0 {
            let _g = self.lock.lock().unwrap_or_else(|e| e.into_inner());
            self.wake.notify_all();
        }
    }

    /// Closes the open job and waits until no worker is inside it; the job may then be dropped.
    fn close(&self) {
        self.state.fetch_and(!OPEN, Ordering::AcqRel);
        let mut spins = 0u32;
        while self.state.load(Ordering::Acquire) & INSIDE != 0 {
            spins += 1;
            if spins < 1 << 14 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
    }

    fn worker(&self) {
        let mut seen = 0u64;
        loop {
            let mut s = self.wait_for_new(seen);
            // Join this epoch's job if it is still open (a closed one is skipped: its tasks are
            // done). A failed exchange means another worker joined or the state moved on.
            while s & OPEN != 0 {
                match self.state.compare_exchange_weak(s, s + 1, Ordering::Acquire, Ordering::Relaxed) {
                    Ok(_) => {
                        let job = self.job.load(Ordering::Relaxed).cast::<Job<'static>>();
                        // SAFETY: we joined the job while it was open (the exchange above,
                        // Acquire, reads the caller's SeqCst store that followed its write of
                        // `job`), so the pointer is this epoch's live job, and its caller does
                        // not return from `close` (so does not drop the job) until we leave it
                        // with the `fetch_sub` below. The `'static` is erased: the reference is
                        // used only inside that window.
                        unsafe { (*job).work() };
                        self.state.fetch_sub(1, Ordering::Release);
                        break;
                    }
                    Err(now) if now >> EPOCH_SHIFT == s >> EPOCH_SHIFT => s = now,
                    Err(_) => break, // a newer job: `wait_for_new` returns it at once
                }
            }
            seen = s >> EPOCH_SHIFT;
        }
    }

    /// Spins, then parks, until `state` carries an epoch other than `seen`; returns it.
    fn wait_for_new(&self, seen: u64) -> u64 {
        let is_new = |s: u64| s >> EPOCH_SHIFT != seen;
        let start = Instant::now();
        let mut i = 0u32;
        loop {
            let s = self.state.load(Ordering::Acquire);
            if is_new(s) {
                return s;
            }
            i = i.wrapping_add(1);
            if i.is_multiple_of(64) && start.elapsed() > SPIN {
                break;
            }
            std::hint::spin_loop();
        }
        let mut g = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        self.sleepers.fetch_add(1, Ordering::SeqCst);
        loop {
            let s = self.state.load(Ordering::SeqCst);
            if is_new(s) {
                self.sleepers.fetch_sub(1, Ordering::SeqCst);
                return s;
            }
            g = self.wake.wait(g).unwrap_or_else(|e| e.into_inner());
        }
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn par_tasks_run_every_task_once_with_the_callers_choices() {
        crate::matmul::set_batch_invariant(true);
        let seen: Vec<std::sync::Mutex<Vec<bool>>> = (0..13).map(|_| std::sync::Mutex::new(Vec::new())).collect();
        par_tasks(13, &|i| seen[i].lock().unwrap().push(crate::matmul::batch_invariant()));
        crate::matmul::set_batch_invariant(false);
        for (i, s) in seen.iter().enumerate() {
            assert_eq!(*s.lock().unwrap(), vec![true], "task {i}");
        }
    }

    use super::*;

    #[test]
    fn every_task_runs_once_across_many_calls() {
        for tasks in [0, 1, 2, 3, 17, 1000] {
            for _ in 0..50 {
                let hits: Vec<AtomicUsize> = (0..tasks).map(|_| AtomicUsize::new(0)).collect();
                run(tasks, &|i| {
                    hits[i].fetch_add(1, Ordering::Relaxed);
                });
                assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1), "tasks {tasks}");
            }
        }
    }

    #[test]
    fn concurrent_and_nested_calls_complete() {
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..100 {
                        let total = AtomicUsize::new(0);
                        run(8, &|i| {
                            run(3, &|j| {
                                total.fetch_add(i * 3 + j, Ordering::Relaxed);
                            })
                        });
                        assert_eq!(total.load(Ordering::Relaxed), (0..24).sum::<usize>());
                    }
                });
            }
        });
    }

    #[test]
    fn a_panicking_task_panics_the_call_and_the_pool_survives() {
        let r = catch_unwind(|| run(16, &|i| assert!(i != 5, "task 5 fails")));
        assert!(r.is_err());
        let n = AtomicUsize::new(0);
        run(16, &|_| {
            n.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(n.load(Ordering::Relaxed), 16);
    }
}
