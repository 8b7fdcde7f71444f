//! memtrace's own figures for `/metrics`: resident memory, CPU time, open descriptors and
//! probe links (read from /proc/self), and how full the ring buffers get — read from the
//! rings' position pages (`probes::ring`) just before each drain.
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

/// Upper bounds of `memtrace_ring_fill_ratio`'s buckets (the last, 1, is a full ring:
/// events are being lost).
pub const FILL_BOUNDS: [f64; 6] = [0.1, 0.25, 0.5, 0.75, 0.9, 1.0];

/// How full the fullest ring was at each drain, as a cumulative histogram: counts only go
/// up, so any number of scrapers read the same figures (a peak taken and reset per scrape
/// would split between them).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct FillHistogram {
    /// Observations per bucket of [`FILL_BOUNDS`] (not cumulative).
    pub buckets: [u64; FILL_BOUNDS.len()],
    pub sum: f64,
    pub count: u64,
}

impl FillHistogram {
    pub fn observe(&mut self, fill: f64) {
        let fill = fill.clamp(0.0, 1.0);
        let i = FILL_BOUNDS.iter().position(|&b| fill <= b).unwrap_or(FILL_BOUNDS.len() - 1);
        self.buckets[i] += 1;
        self.sum += fill;
        self.count += 1;
    }
}

/// Observes how full the fullest ring is now, just before a drain (between two drains a
/// ring only fills, so this is the interval's peak).
pub fn sample_fill(rings: &[Ring], histogram: &std::sync::Mutex<FillHistogram>) {
    let fill = fullest(rings);
    histogram.lock().unwrap_or_else(|e| e.into_inner()).observe(fill);
}
