//! The peak (heaptrack's "peak", memray's high-water mark): per domain, the moment its live
//! bytes were highest, and each group's live bytes and blocks at that very moment.
//!
//! A snapshot of every group at each new high would cost O(groups) per allocation while
//! memory grows. Instead each group's value at the latest high is captured lazily: a group
//! not changed since the latest high still holds its value from then, so it is copied the
//! next time the group changes (or at the end).
//!
//! Live here means not freed and the process still running: a process's blocks stop
//! counting when it exits (its memory is gone), though reports still list them as leaked.
use std::collections::BTreeMap;

use serde::Serialize;

use super::{Domain, Stats, Totals};

/// The highest live bytes of a domain, and when.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Peak {
    /// When it was first reached (monotonic clock, as events).
    pub ts_ns: u64,
    pub live_bytes_req: u64,
    pub live_allocs: u64,
}

#[derive(Debug, Clone, Default)]
struct DomainLive {
    bytes: u64,
    allocs: u64,
    peak: Peak,
    /// Sequence number of the change that set the peak.
    peak_seq: u64,
}

#[derive(Debug, Clone, Copy)]
struct GroupLive {
    domain: Domain,
    bytes: u64,
    allocs: u64,
    /// Sequence number of the group's latest change.
    changed: u64,
    at_peak: (u64, u64),
}

/// Follows live bytes per group and per domain; see the module's comment.
#[derive(Debug, Default)]
pub struct PeakTracker {
    seq: u64,
    domains: BTreeMap<Domain, DomainLive>,
    groups: Vec<GroupLive>,
}

impl PeakTracker {
    /// `allocs` blocks of `bytes` bytes in all of group `group` (of `domain`) became live
    /// (`added`) or stopped being live, at `ts_ns`.
    pub fn change(&mut self, group: u32, domain: Domain, bytes: u64, allocs: u64, added: bool, ts_ns: u64) {
        self.seq += 1;
        let d = self.domains.entry(domain).or_default();
        let g = group as usize;
        if self.groups.len() <= g {
            let unseen = GroupLive { domain, bytes: 0, allocs: 0, changed: 0, at_peak: (0, 0) };
            self.groups.resize(g + 1, unseen);
        }
        let gl = &mut self.groups[g];
        gl.domain = domain;
        if gl.changed <= d.peak_seq {
            // Unchanged since the domain's latest high: that is its value at the high.
            gl.at_peak = (gl.bytes, gl.allocs);
        }
        gl.changed = self.seq;
        if added {
            gl.bytes += bytes;
            gl.allocs += allocs;
            d.bytes += bytes;
            d.allocs += allocs;
            if d.bytes > d.peak.live_bytes_req {
                d.peak = Peak { ts_ns, live_bytes_req: d.bytes, live_allocs: d.allocs };
                d.peak_seq = self.seq;
            }
        } else {
            gl.bytes = gl.bytes.saturating_sub(bytes);
            gl.allocs = gl.allocs.saturating_sub(allocs);
            d.bytes = d.bytes.saturating_sub(bytes);
            d.allocs = d.allocs.saturating_sub(allocs);
        }
    }

    /// Group `group`'s (bytes, blocks) live at its domain's peak.
    pub fn at_peak(&self, group: u32) -> (u64, u64) {
        let Some(g) = self.groups.get(group as usize) else {
            return (0, 0);
        };
        let peak_seq = self.domains.get(&g.domain).map_or(0, |d| d.peak_seq);
        if g.changed <= peak_seq { (g.bytes, g.allocs) } else { g.at_peak }
    }

    /// Writes each group's share of its domain's peak into its figures, and each domain's
    /// peak into its totals (there, the peak does not count the blocks of exited processes).
    pub fn settle(&self, groups: &mut [Stats], totals: &mut BTreeMap<Domain, Totals>) {
        for (g, stats) in groups.iter_mut().enumerate() {
            (stats.live_bytes_req_at_peak, stats.live_allocs_at_peak) = self.at_peak(g as u32);
        }
        for (domain, d) in &self.domains {
            let stats = &mut totals.entry(*domain).or_default().stats;
            stats.peak_live_bytes_req = d.peak.live_bytes_req;
            (stats.live_bytes_req_at_peak, stats.live_allocs_at_peak) = (d.peak.live_bytes_req, d.peak.live_allocs);
        }
    }

    /// Each domain's peak.
    pub fn peaks(&self) -> BTreeMap<Domain, Peak> {
        self.domains.iter().map(|(d, l)| (*d, l.peak)).collect()
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn groups_are_read_at_the_domains_high() {
        let mut p = PeakTracker::default();
        let u = Domain::User;
        p.change(0, u, 800, 8, true, 10); // group 0 grows to 800...
        p.change(0, u, 800, 8, false, 20); // ...and is gone before the high
        p.change(1, u, 300, 3, true, 30);
        p.change(2, u, 700, 7, true, 40); // the high: 1000 at 40
        p.change(2, u, 700, 7, false, 50);
        p.change(3, u, 600, 1, true, 60); // 900 < 1000
        p.change(1, u, 100, 1, false, 70);
        p.change(9, Domain::Kernel, 64, 1, true, 80);
        assert_eq!(p.peaks()[&u], Peak { ts_ns: 40, live_bytes_req: 1000, live_allocs: 10 });
        assert_eq!(p.peaks()[&Domain::Kernel], Peak { ts_ns: 80, live_bytes_req: 64, live_allocs: 1 });
        let at: Vec<(u64, u64)> = (0..4).map(|g| p.at_peak(g)).collect();
        assert_eq!(at, [(0, 0), (300, 3), (700, 7), (0, 0)]);
        assert_eq!(p.at_peak(9), (64, 1));
        assert_eq!(p.at_peak(5), (0, 0), "a group never seen");
        assert_eq!(p.at_peak(42), (0, 0));
    }

    proptest! {
        /// The lazy capture agrees with snapshotting every group at every new high.
        #[test]
        fn lazy_capture_equals_snapshots(ops in prop::collection::vec((0u32..6, 1u64..1000, any::<bool>()), 1..200)) {
            let mut p = PeakTracker::default();
            let mut live = [0u64; 6];
            let (mut high, mut snapshot) = (0u64, [0u64; 6]);
            for (ts, (g, bytes, add)) in ops.into_iter().enumerate() {
                let bytes = if add { bytes } else { bytes.min(live[g as usize]) };
                if bytes == 0 { continue; }
                p.change(g, Domain::User, bytes, 1, add, ts as u64);
                if add { live[g as usize] += bytes } else { live[g as usize] -= bytes }
                let total: u64 = live.iter().sum();
                if total > high {
                    high = total;
                    snapshot = live;
                }
            }
            for g in 0..6 {
                prop_assert_eq!(p.at_peak(g).0, snapshot[g as usize], "group {}", g);
            }
            prop_assert_eq!(p.peaks().get(&Domain::User).map_or(0, |x| x.live_bytes_req), high);
        }
    }
}
