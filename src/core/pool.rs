//! The rayon pool: sized by `DELTASYNC_NUM_THREADS` (bounded by `max_threads`), and rebuilt lazily in a forked
//! child, whose copy of the parent's pool has no threads behind it.
//!
//! Fork safety: a thread may call fork() at any moment, and the child has only that thread. So nothing here blocks
//! on a lock that another thread could hold across a fork: the requested size is an atomic, the pool slot is
//! guarded by `SlotLock` (which a forked child takes over from the parent's threads), and a new pool is built,
//! threads spawned, with no lock held.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

/// The most threads a pool gets, whatever is asked for: a bad `DELTASYNC_NUM_THREADS` (say 20000) must not spawn
/// 20000 threads.
pub const MAX_THREADS_FLOOR: usize = 256;

/// 0 until `set_num_threads(n > 0)`; then `n`.
static REQUESTED: AtomicUsize = AtomicUsize::new(0);
/// `available_parallelism`, cached (0 until first read): it reads cgroup files on every call.
static CPUS: AtomicUsize = AtomicUsize::new(0);

/// The pools of one process, newest last. Pools of other sizes are kept, idle, while their threads add up to at most
/// `KEPT_THREADS`: a caller that switches between a few sizes reuses them instead of tearing threads down and
/// spawning new ones each time. (A fork() while another thread's pool threads start or exit has, rarely, left the
/// child's heap corrupted: about one child in 4,000 in tests/test_fork.py's rebuilding scenario, none in 12,000 when
/// no pool was rebuilt.)
struct Entry {
    owner: u32,
    pools: Vec<(usize, Arc<rayon::ThreadPool>)>,
}

impl Entry {
    fn find(&self, size: usize) -> Option<Arc<rayon::ThreadPool>> {
        self.pools.iter().find(|(s, _)| *s == size).map(|(_, pool)| Arc::clone(pool))
    }
}

/// Idle threads kept in pools of sizes not asked for now (beyond the pool in use).
const KEPT_THREADS: usize = 64;

static SLOT: SlotLock = SlotLock::new();

/// The number of CPUs this process may use (at least 1).
fn cpus() -> usize {
    match CPUS.load(Ordering::Relaxed) {
        0 => {
            let n = std::thread::available_parallelism().map_or(1, usize::from);
            CPUS.store(n, Ordering::Relaxed);
            n
        }
        n => n,
    }
}

/// The bound on the thread count: 4 threads per CPU, or `MAX_THREADS_FLOOR` on small machines.
pub fn max_threads() -> usize {
    cpus().saturating_mul(4).max(MAX_THREADS_FLOOR)
}

/// Threads to use: `set_num_threads`, else `DELTASYNC_NUM_THREADS`, else the number of CPUs; at most
/// `max_threads()`.
pub fn num_threads() -> usize {
    let requested = match REQUESTED.load(Ordering::Relaxed) {
        0 => std::env::var("DELTASYNC_NUM_THREADS")
            .ok()
            .and_then(|value| value.trim().parse::<usize>().ok())
            .filter(|&n| n > 0)
            .unwrap_or_else(cpus),
        n => n,
    };
    requested.min(max_threads())
}

/// Overrides the thread count for later calls (0 restores the default); returns the count that will be used,
/// which is at most `max_threads()`.
pub fn set_num_threads(n: usize) -> usize {
    REQUESTED.store(n.min(max_threads()), Ordering::Relaxed);
    num_threads()
}

/// A lock around the pool slot that a forked child can take over. The word holds 0 when free, else the pid of
/// the process whose thread holds it. Threads of one process share a pid, so they wait for each other; a
/// holder's pid that is not ours means the holder was a thread of the parent when this process was forked, and
/// no longer exists here.
struct SlotLock {
    holder: AtomicU64,
    entry: std::cell::UnsafeCell<Option<Entry>>,
}

// SAFETY: `entry` is only touched through `with`, which holds the lock.
unsafe impl Sync for SlotLock {}

impl SlotLock {
    const fn new() -> Self {
        SlotLock { holder: AtomicU64::new(0), entry: std::cell::UnsafeCell::new(None) }
    }

    /// Runs `f` on the slot with the lock held. `f` must be short: it never spawns or joins threads.
    fn with<R>(&self, pid: u32, f: impl FnOnce(&mut Option<Entry>) -> R) -> R {
        let me = u64::from(pid);
        let mut spins = 0u32;
        loop {
            match self.holder.compare_exchange_weak(0, me, Ordering::Acquire, Ordering::Relaxed) {
                Ok(_) => break,
                Err(0) => {}
                Err(holder) if holder == me => {
                    spins += 1;
                    if spins > 64 {
                        std::thread::yield_now();
                    } else {
                        std::hint::spin_loop();
                    }
                }
                Err(parent) => {
                    // Taken by a parent thread that fork() did not copy. Whatever it was writing may be half
                    // written: overwrite the slot without reading or dropping it (leaking the parent's pool).
                    if self.holder.compare_exchange(parent, me, Ordering::Acquire, Ordering::Relaxed).is_ok() {
                        // SAFETY: we hold the lock now; `write` does not read the old value.
                        unsafe { std::ptr::write(self.entry.get(), None) };
                        break;
                    }
                }
            }
        }
        // SAFETY: the lock is held until the store below.
        let result = f(unsafe { &mut *self.entry.get() });
        self.holder.store(0, Ordering::Release);
        result
    }
}

/// Initialises the lazy statics that pool threads touch, so that no fork() can find one half initialised: a
/// child then waits forever for the initialiser, a thread it does not have (tests/test_fork.py). The one that
/// matters is crossbeam's global epoch collector, behind a `Once`, which rayon's work-stealing deques use. The
/// bindings call this when the module is imported; building a pool calls it too, before spawning threads.
pub fn init_statics() {
    drop(crossbeam_epoch::pin());
}

fn build(threads: usize) -> Arc<rayon::ThreadPool> {
    init_statics();
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(|i| format!("deltasync-{i}"))
        .build()
        .or_else(|_| rayon::ThreadPoolBuilder::new().num_threads(1).build())
        .map(Arc::new)
        .expect("a one-thread pool")
}

fn pool() -> Arc<rayon::ThreadPool> {
    pool_sized(num_threads())
}

/// This process's pool of `threads` threads, built (and kept, see `Entry`) when there is none.
fn pool_sized(threads: usize) -> Arc<rayon::ThreadPool> {
    let pid = std::process::id();
    let current = SLOT.with(pid, |slot| slot.as_ref().filter(|e| e.owner == pid).and_then(|e| e.find(threads)));
    if let Some(pool) = current {
        return pool;
    }
    // Spawn the new pool's threads with no lock held, so a fork meanwhile cannot leave the child waiting.
    let built = build(threads);
    let (chosen, dropped) = SLOT.with(pid, |slot| {
        if let Some(entry) = slot.as_mut().filter(|e| e.owner == pid) {
            // Another thread installed a pool of this size meanwhile: use it, and drop ours outside the lock.
            if let Some(pool) = entry.find(threads) {
                return (pool, vec![built]);
            }
            entry.pools.push((threads, Arc::clone(&built)));
            // Keep the newest pools whose threads fit in the budget, beside the one in use.
            let mut kept = 0;
            let mut stale = Vec::new();
            let mut index = entry.pools.len() - 1;
            while index > 0 {
                index -= 1;
                if kept + entry.pools[index].0 <= KEPT_THREADS {
                    kept += entry.pools[index].0;
                } else {
                    stale.push(entry.pools.remove(index).1);
                }
            }
            return (built, stale);
        }
        if let Some(inherited) = slot.replace(Entry { owner: pid, pools: vec![(threads, Arc::clone(&built))] }) {
            // Inherited through fork(): its worker threads do not exist here, so dropping it could wait on them
            // forever. Leak it instead.
            std::mem::forget(inherited);
        }
        (built, Vec::new())
    });
    drop(dropped);
    chosen
}

/// Runs `op` inside the deltasync pool.
pub fn install<R: Send>(op: impl FnOnce() -> R + Send) -> R {
    pool().install(op)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thread_count_is_bounded() {
        assert_eq!(set_num_threads(20_000), max_threads());
        assert!(max_threads() >= MAX_THREADS_FLOOR);
        assert_eq!(install(rayon::current_num_threads), max_threads());
        assert_eq!(set_num_threads(3), 3);
        assert_eq!(install(rayon::current_num_threads), 3);
        set_num_threads(0);
    }

    #[test]
    fn switching_sizes_reuses_pools_within_the_budget() {
        // Sizes that no other test asks for (tests share the process's pools).
        let (five, seven) = (pool_sized(5), pool_sized(7));
        assert!(Arc::ptr_eq(&pool_sized(5), &five) && Arc::ptr_eq(&pool_sized(7), &seven));
        assert_eq!(five.current_num_threads(), 5);
        // A pool over the budget is dropped once a pool of another size is built.
        let big = pool_sized(KEPT_THREADS + 1);
        pool_sized(6);
        assert!(!Arc::ptr_eq(&pool_sized(KEPT_THREADS + 1), &big));
        assert!(Arc::ptr_eq(&pool_sized(5), &five));
    }

    #[test]
    fn a_lock_held_by_a_forked_away_thread_is_taken_over() {
        let lock = SlotLock::new();
        let me = std::process::id();
        // As fork() leaves it when a parent thread held it.
        lock.holder.store(u64::from(me) + 1, Ordering::Relaxed);
        assert!(lock.with(me, |slot| slot.is_none()));
        assert_eq!(lock.holder.load(Ordering::Relaxed), 0);
    }
}
