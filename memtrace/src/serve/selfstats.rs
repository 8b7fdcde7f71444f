//! memtrace's own figures for `/metrics`: resident memory, CPU time, open descriptors and
//! probe links (read from /proc/self), and how full the ring buffers get — read from the
//! rings' position pages (`probes::ring`) just before each drain.
use std::sync::atomic::{AtomicU64, Ordering};

use crate::probes::Ring;

/// Resident memory of this process, in bytes.
pub fn resident_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = statm.split_whitespace().nth(1).and_then(|v| v.parse().ok()).unwrap_or(0);
    pages * page_size()
}

fn page_size() -> u64 {
    // SAFETY: sysconf has no preconditions.
    unsafe { libc::sysconf(libc::_SC_PAGESIZE) as u64 }
}

/// CPU time of this process (user and system), in seconds.
pub fn cpu_seconds() -> f64 {
    // SAFETY: getrusage fills the struct it is given; RUSAGE_SELF is always valid.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// Open descriptors, and of those the probe links (BPF links and perf events).
pub fn descriptors() -> (u64, u64) {
    let Ok(entries) = std::fs::read_dir("/proc/self/fd") else { return (0, 0) };
    let mut open = 0;
    let mut probes = 0;
    for entry in entries.flatten() {
        open += 1;
        if let Ok(target) = std::fs::read_link(entry.path()) {
            let t = target.to_string_lossy();
            if t == "anon_inode:bpf_link" || t == "anon_inode:[perf_event]" {
                probes += 1;
            }
        }
    }
    (open, probes)
}

/// The fullest ring's share of its size now.
fn fullest(rings: &[Ring]) -> f64 {
    rings.iter().map(|r| (r.ring.waiting_bytes() as f64 / r.ring.size().max(1) as f64).min(1.0)).fold(0.0, f64::max)
}

/// Records how full the rings are now into `peak` (the largest since it was last taken).
pub fn sample_fill(rings: &[Ring], peak: &AtomicU64) {
    // Non-negative floats order as their bits do.
    peak.fetch_max(fullest(rings).to_bits(), Ordering::Relaxed);
}

/// Takes the peak fill recorded since the last call.
pub fn take_peak(peak: &AtomicU64) -> f64 {
    f64::from_bits(peak.swap(0, Ordering::Relaxed))
}
