//! Memory over time and the peak, as a report shows them: the timeline's series made dense
//! (per domain, and the processes that held the most), times counted from the start of the
//! recording, and each domain's peak.
use std::collections::BTreeMap;

use crate::analysis::{Domain, Peak, Timeline};

/// Processes given a series of their own, at most (those that held the most).
pub const MAX_PROCESSES: usize = 10;

/// Rows given a series of their own with `--timeline`, at most (the first ones).
pub const MAX_ROW_SERIES: usize = 10;

/// Live bytes over time; see the module's comment.
#[derive(Debug, Clone, Default)]
pub struct MemoryView {
    /// Time 0: the start of the recording (monotonic clock).
    pub origin_ns: u64,
    /// Length of an interval; interval i covers [i·interval_ns, (i+1)·interval_ns).
    pub interval_ns: u64,
    /// The most bytes (requested) live at once within each interval, per domain.
    pub domains: BTreeMap<Domain, Vec<u64>>,
    /// The same for the processes that held the most, most first: (pid, series).
    pub processes: Vec<(u32, Vec<u64>)>,
    /// Each domain's peak; its time is on the monotonic clock (see [`MemoryView::since_start`]).
    pub peaks: BTreeMap<Domain, Peak>,
}

impl MemoryView {
    /// The view of `timeline` up to `end_ns`.
    pub fn new(timeline: &mut Timeline, end_ns: u64, peaks: BTreeMap<Domain, Peak>) -> Self {
        let n = timeline.intervals_until(end_ns);
        let domains = timeline.domains.iter().map(|(d, s)| (*d, s.dense(n))).collect();
        let mut processes: Vec<(u32, u64)> = timeline.processes.iter().map(|(p, s)| (*p, s.max())).collect();
        processes.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        let processes = processes
            .into_iter()
            .take(MAX_PROCESSES)
            .filter(|(_, max)| *max > 0)
            .map(|(pid, _)| (pid, timeline.processes[&pid].dense(n)))
            .collect();
        Self { origin_ns: timeline.origin_ns, interval_ns: timeline.interval_ns, domains, processes, peaks }
    }

    /// How many intervals the series hold.
    pub fn intervals(&self) -> usize {
        self.domains.values().next().map_or(0, Vec::len)
    }

    /// A monotonic time as time since the start of the recording.
    pub fn since_start(&self, ts_ns: u64) -> u64 {
        ts_ns.saturating_sub(self.origin_ns)
    }

    /// The interval `ts_ns` (monotonic) falls in.
    pub fn interval_of(&self, ts_ns: u64) -> usize {
        (self.since_start(ts_ns) / self.interval_ns.max(1)) as usize
    }
}
