//! Keeping a pool's workers awake through a run of many short parallel kernels.
//!
//! A rayon worker that finds no work for a few rounds goes to sleep, and waking it costs tens of
//! microseconds (a futex, then the scheduler). A decode step runs about 150 parallel kernels a
//! few microseconds of serial work apart, so without help its workers sleep and wake around each
//! one: on SmolLM2-135M with 2 threads that was about 17 µs a projection, a quarter of the step
//! (decode 125-135 tok/s; 165-179 with [`polling`]). [`polling`] runs a closure on the pool while
//! the pool's other workers poll for its work instead (`rayon::yield_now`, which runs a pending
//! job if there is one), yielding their core to the OS between polls so that a busy machine's
//! other threads still run (spinning without yielding measured no faster on an idle machine, and
//! under two models at once each's spinning workers held the core the other's kernels waited
//! for). They take each kernel's jobs as soon as the kernel splits them.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// How long a worker polls without finding work before it stops (and may sleep as usual): far
/// longer than the serial work between two kernels of a step, far shorter than a human notices.
const IDLE: Duration = Duration::from_millis(2);

/// Runs `f` on `pool` (as `install` does) while the pool's other workers poll for the jobs `f`
/// splits off, until `f` returns (or panics) or they find none for [`IDLE`].
pub fn polling<T: Send>(pool: &rayon::ThreadPool, f: impl FnOnce() -> T + Send) -> T {
    pool.install(|| {
        let done = AtomicBool::new(false);
        let caller = rayon::current_thread_index();
        rayon::scope(|scope| {
            for _ in 1..rayon::current_num_threads() {
                let done = &done;
                scope.spawn(move |_| poll(done, caller));
            }
            // Set when `f` returns or unwinds, so the pollers never outlive it by more than a poll.
            let _done = Done(&done);
            f()
        })
    })
}

/// Sets its flag when dropped.
struct Done<'a>(&'a AtomicBool);

impl Drop for Done<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Release);
    }
}

/// One worker's polling, until `done` or [`IDLE`] without work.
fn poll(done: &AtomicBool, caller: Option<usize>) {
    // The caller's own thread pops a poller it spawned when it waits in a join before another
    // worker took it: there it would only delay the caller, so it returns at once.
    if rayon::current_thread_index() == caller {
        return;
    }
    let mut last = Instant::now();
    while !done.load(Ordering::Acquire) {
        if let Some(rayon::Yield::Executed) = rayon::yield_now() {
            last = Instant::now();
            continue;
        }
        if last.elapsed() > IDLE {
            return;
        }
        // Never a bare spin: where another thread waits for this core (a second model's
        // kernels, the caller of a busy machine), it runs now, not at the end of a time slice.
        std::thread::yield_now();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rayon::prelude::*;

    #[test]
    fn runs_the_closure_and_its_parallel_work_and_returns() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
        let sum = polling(&pool, || {
            (0..200u64).map(|step| (0..1000u64).into_par_iter().map(|i| i * step).sum::<u64>()).sum::<u64>()
        });
        assert_eq!(sum, (0..200u64).sum::<u64>() * (0..1000u64).sum::<u64>());
        // A one-thread pool has no one to poll; a panic reaches the caller and stops the pollers.
        let one = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
        assert_eq!(polling(&one, || 7), 7);
        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| polling(&pool, || panic!("a step"))));
        assert!(caught.is_err());
        assert_eq!(polling(&pool, || (0..10u32).into_par_iter().sum::<u32>()), 45);
    }
}
