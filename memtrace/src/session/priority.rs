//! memtrace's own scheduling priority while it traces (`--nice`): the threads that drain the
//! rings and build unwind tables run ahead of the traced load, and the command it starts
//! runs at the niceness memtrace was started with.
//!
//! On a busy machine (a CPU hog per core and ten new processes at once) the drain got the
//! same share of the CPUs as each traced process: the rings filled with the stack copies new
//! programs send until their tables are built, and copies were refused (0.1–6.8 % of user
//! stacks cut short in 4 runs of 6). At niceness −10, 0 in 6 of 6. memtrace's own CPU is
//! what its events cost (0.4 s for 10 s of that load), so running it first takes little
//! from the traced programs; it is the lag that cost them stacks. (`perf record -r` offers
//! the same with a real-time priority.)
use std::sync::atomic::{AtomicI32, Ordering};

/// The niceness memtrace takes when none is asked for and it was started at the usual 0.
pub const DEFAULT_NICE: i32 = -10;

/// No niceness recorded (outside the range the kernel takes, −20 to 19).
const UNSET: i32 = i32::MIN;

/// The niceness memtrace was started with, once it chose its own.
static STARTED: AtomicI32 = AtomicI32::new(UNSET);
/// The niceness memtrace's threads run at, once it took one (then a command it starts gets
/// [`STARTED`] back).
static OWN: AtomicI32 = AtomicI32::new(UNSET);

/// What memtrace does with its niceness.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Niceness {
    /// Keeps the one it was started with (`serve` without `--nice`: an agent that samples).
    Keep,
    /// Takes this one (`--nice`), or by default the one [`chosen`] names.
    Take(Option<i32>),
}

/// The niceness to take: the one asked for; by default [`DEFAULT_NICE`] when started at 0,
/// else the one started with (`nice -n 19 memtrace record …` stays at 19). `None`: keep it.
pub fn chosen(asked: Option<i32>, caller: i32) -> Option<i32> {
    match asked {
        Some(n) => Some(n.clamp(-20, 19)).filter(|&n| n != caller),
        None => (caller == 0).then_some(DEFAULT_NICE),
    }
}

/// The calling thread's niceness.
pub fn current() -> i32 {
    // getpriority returns the niceness itself, and -1 is a valid one: errno tells.
    // SAFETY: plain syscalls on this thread's own id.
    unsafe {
        *libc::__errno_location() = 0;
        let n = libc::getpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t);
        if *libc::__errno_location() != 0 { 0 } else { n }
    }
}

/// Notes the niceness memtrace was started with and, where `niceness` takes one, gives
/// every thread of memtrace that runs at the niceness it was started with (not the
/// symbolizer's deliberately low one) niceness `nice`; threads started later inherit it from
/// the thread that starts them. Lowering a niceness takes CAP_SYS_NICE: without it
/// (CAP_BPF and CAP_PERFMON alone) memtrace stays where it was, and says so in the debug log.
pub fn take(niceness: Niceness) {
    let caller = current();
    STARTED.store(caller, Ordering::Relaxed);
    let Niceness::Take(asked) = niceness else { return };
    let Some(nice) = chosen(asked, caller) else { return };
    let tids: Vec<libc::id_t> = std::fs::read_dir("/proc/self/task")
        .map(|dir| dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok()).collect())
        // SAFETY: a plain syscall.
        .unwrap_or_else(|_| vec![unsafe { libc::gettid() } as libc::id_t]);
    let mut took = false;
    for tid in tids {
        // SAFETY: plain syscalls on a thread of this process (one that ended fails, harmlessly).
        unsafe {
            *libc::__errno_location() = 0;
            let n = libc::getpriority(libc::PRIO_PROCESS, tid);
            if *libc::__errno_location() != 0 || n != caller {
                continue;
            }
            if libc::setpriority(libc::PRIO_PROCESS, tid, nice) != 0 {
                log::debug!("memtrace keeps niceness {caller}: {}", std::io::Error::last_os_error());
                return;
            }
        }
        took = true;
    }
    if took {
        log::debug!("memtrace runs at niceness {nice} (started at {caller})");
        OWN.store(nice, Ordering::Relaxed);
    }
}

/// The niceness memtrace was started with, where it took another: what a command it
/// starts gets back.
pub fn caller() -> Option<i32> {
    (OWN.load(Ordering::Relaxed) != UNSET).then(|| STARTED.load(Ordering::Relaxed))
}

/// The niceness memtrace's threads run at (the symbolizer's, once hurried): the one it took,
/// else the one it was started with.
pub fn own() -> i32 {
    [OWN.load(Ordering::Relaxed), STARTED.load(Ordering::Relaxed)].into_iter().find(|&n| n != UNSET).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn by_default_only_a_usual_start_is_raised() {
        assert_eq!(chosen(None, 0), Some(DEFAULT_NICE));
        assert_eq!(chosen(None, 19), None, "nice -n 19 memtrace … is kept");
        assert_eq!(chosen(None, -5), None);
    }

    #[test]
    fn an_asked_niceness_is_taken_within_the_kernels_range() {
        assert_eq!(chosen(Some(-3), 0), Some(-3));
        assert_eq!(chosen(Some(5), 19), Some(5));
        assert_eq!(chosen(Some(-40), 0), Some(-20));
        assert_eq!(chosen(Some(0), 0), None, "already there");
    }
}
