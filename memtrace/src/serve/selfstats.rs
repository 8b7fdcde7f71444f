//! memtrace's own figures for `/metrics`: resident memory, CPU time, open descriptors and
//! probe links (read from /proc/self), and how full the ring buffers get — read from the
//! rings' own position pages, mapped read-only, just before each drain.
use std::{
    os::fd::AsRawFd as _,
    sync::atomic::{AtomicU64, Ordering},
};

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

/// A ring's consumer and producer positions, mapped read-only.
struct Positions {
    consumer: *const u64,
    producer: *const u64,
}

/// How full the rings are.
pub struct RingFill {
    rings: Vec<Positions>,
    size: u64,
}

impl RingFill {
    /// Maps the position pages of every ring (rings that cannot be mapped are skipped).
    pub fn new(rings: &mut [Ring], size: u32) -> Self {
        let page = page_size() as usize;
        let map = |fd: i32, offset: usize| -> Option<*const u64> {
            // SAFETY: maps one page of a ring buffer map read-only; the kernel allows any
            // read-only mapping of it. Unmapped in Drop.
            let p = unsafe {
                libc::mmap(std::ptr::null_mut(), page, libc::PROT_READ, libc::MAP_SHARED, fd, offset as libc::off_t)
            };
            (p != libc::MAP_FAILED).then_some(p as *const u64)
        };
        let rings = rings
            .iter()
            .filter_map(|r| {
                let fd = r.ring.as_raw_fd();
                let consumer = map(fd, 0)?;
                match map(fd, page) {
                    Some(producer) => Some(Positions { consumer, producer }),
                    None => {
                        // SAFETY: unmaps the page mapped just above.
                        unsafe { libc::munmap(consumer as *mut libc::c_void, page) };
                        None
                    }
                }
            })
            .collect();
        Self { rings, size: u64::from(size) }
    }

    /// The fullest ring's share of its size now.
    pub fn fullest(&self) -> f64 {
        let mut most = 0u64;
        for r in &self.rings {
            // SAFETY: the pages stay mapped while self lives; the kernel updates the
            // positions concurrently, hence the volatile reads (a torn view only skews one
            // sample of a gauge).
            let (c, p) = unsafe { (std::ptr::read_volatile(r.consumer), std::ptr::read_volatile(r.producer)) };
            most = most.max(p.saturating_sub(c));
        }
        (most as f64 / self.size.max(1) as f64).min(1.0)
    }

    /// Records the fill now into `peak` (the largest since it was last taken).
    pub fn sample(&self, peak: &AtomicU64) {
        // Non-negative floats order as their bits do.
        peak.fetch_max(self.fullest().to_bits(), Ordering::Relaxed);
    }
}

impl Drop for RingFill {
    fn drop(&mut self) {
        let page = page_size() as usize;
        for r in &self.rings {
            // SAFETY: both pages were mapped in `new` and are not used after this.
            unsafe {
                libc::munmap(r.consumer as *mut libc::c_void, page);
                libc::munmap(r.producer as *mut libc::c_void, page);
            }
        }
    }
}

/// Takes the peak fill recorded since the last call.
pub fn take_peak(peak: &AtomicU64) -> f64 {
    f64::from_bits(peak.swap(0, Ordering::Relaxed))
}
