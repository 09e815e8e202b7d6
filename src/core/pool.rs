//! The rayon pool: sized by `DELTASYNC_NUM_THREADS`, and rebuilt in a forked child, whose copy of the
//! parent's pool has no threads behind it.

use std::sync::{Arc, Mutex};

static POOL: Mutex<Option<(u32, usize, Arc<rayon::ThreadPool>)>> = Mutex::new(None);
static REQUESTED: Mutex<Option<usize>> = Mutex::new(None);

/// Threads to use: `set_num_threads`, else `DELTASYNC_NUM_THREADS`, else the number of CPUs.
pub fn num_threads() -> usize {
    if let Some(n) = *REQUESTED.lock().unwrap_or_else(|e| e.into_inner()) {
        return n;
    }
    std::env::var("DELTASYNC_NUM_THREADS")
        .ok()
        .and_then(|value| value.trim().parse::<usize>().ok())
        .filter(|&n| n > 0)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, usize::from))
}

/// Overrides the thread count for later calls (0 restores the default).
pub fn set_num_threads(n: usize) {
    *REQUESTED.lock().unwrap_or_else(|e| e.into_inner()) = (n > 0).then_some(n);
}

fn pool() -> Arc<rayon::ThreadPool> {
    let pid = std::process::id();
    let threads = num_threads();
    let mut slot = POOL.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((owner, size, pool)) = slot.as_ref() {
        if *owner == pid && *size == threads {
            return Arc::clone(pool);
        }
    }
    if let Some((owner, _, stale)) = slot.take() {
        if owner != pid {
            // Inherited through fork(): its worker threads do not exist here, so dropping it could
            // wait on them forever. Leak it instead.
            std::mem::forget(stale);
        }
    }
    let built = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(|i| format!("deltasync-{i}"))
        .build()
        .map(Arc::new)
        .unwrap_or_else(|_| {
            Arc::new(rayon::ThreadPoolBuilder::new().num_threads(1).build().expect("a one-thread pool"))
        });
    *slot = Some((pid, threads, Arc::clone(&built)));
    built
}

/// Runs `op` inside the deltasync pool.
pub fn install<R: Send>(op: impl FnOnce() -> R + Send) -> R {
    pool().install(op)
}
